"""The `exl2cpp` command line: run, chat, ppl, info, serve, import-gguf and convert on top of the Python API.

    exl2cpp run "Why is the sky blue?"                  # default model: SmolLM2-135M-Instruct
    exl2cpp run ./my-model "Once upon a time" --raw --max-new-tokens 64
    exl2cpp chat                                         # interactive; /reset, /exit, Ctrl-D
    exl2cpp ppl ./my-model text.txt --ctx 2048
    exl2cpp info smollm2 --json
    exl2cpp import-gguf model.gguf ./model
    exl2cpp serve smollm2 --port 8000 --api-key sk-local    # OpenAI-compatible server (docs/server.md)
    exl2cpp convert ./fp16-model ./model-4.65bpw --bits 4.65

Exit status (docs/cli.md): 0 done, 1 an error (one line ``exl2cpp: error: ...``), 2 bad arguments (argparse's
convention, also for values checked after parsing), 130 Ctrl-C, 143 SIGTERM (every command but serve, which
drains on SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from . import __version__
from .errors import Exl2Error, OutOfMemoryError, UnsupportedError

PROG = "exl2cpp"

_SAMPLING = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "seed",
)


class _UsageError(Exception):
    """A command-line mistake found after parsing (argparse reports the rest)."""


class _Terminated(BaseException):
    """SIGTERM arrived: unwinds like Ctrl-C (pools and engines close) and exits 143 = 128 + SIGTERM."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated


def _device(text: str) -> str:
    if text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f'expected "cpu", "cuda" or "cuda:N", got {text!r}')


def _checked_by(check):
    """An argparse type that keeps the string and lets the library's parser judge it (its message on error)."""

    def parse(text: str) -> str:
        try:
            check(text)
        except Exl2Error as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return parse


def _gpu_split(text: str) -> str:
    from .multigpu import parse_gpu_split

    return _checked_by(lambda t: parse_gpu_split(t, 1 << 30))(text)  # the GPU count is checked at load


def _tensor_parallel(text: str) -> str:
    from .tensor_parallel import tensor_parallel_kwargs

    return _checked_by(tensor_parallel_kwargs)(text)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=_device, default="cpu", help='"cpu" (default), "cuda" or "cuda:N"')
    p.add_argument("--gpu-split", type=_gpu_split, default=None, metavar="GB,GB|auto",
                   help='split the layers across GPUs (with --device cuda): GB per GPU such as "20,24", or "auto"')
    p.add_argument("--tensor-parallel", type=_tensor_parallel, default=None, metavar="all|N|GPU,GPU",
                   help='split every layer across GPUs (heads and MLP columns, NCCL): "all" visible GPUs, N ranks, '
                        'or CUDA indices such as "0,1" (with --device cpu: N virtual ranks, for testing)')
    p.add_argument("--max-seq-len", type=_int_at_least(1), default=None,
                   help="context length to allocate (default: the model's)")


# Model.generate / Model.stream's defaults (tests/test_cli.py checks them against the signature); `run` is greedy.
API_DEFAULTS = {"max_new_tokens": 256, "temperature": 0.7, "top_k": 0, "top_p": 0.9, "min_p": 0.0,
                "repetition_penalty": 1.0}  # fmt: skip
RUN_DEFAULTS = {**API_DEFAULTS, "temperature": 0.0}


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _add_sampling_options(p: argparse.ArgumentParser, defaults: dict[str, Any], note: str) -> None:
    g = p.add_argument_group(f"sampling ({note})")
    d = defaults
    g.add_argument("--max-new-tokens", "-n", type=_int_at_least(0), default=None,
                   help=f"tokens to generate at most (default {d['max_new_tokens']})")
    g.add_argument("--temperature", "-t", type=float, default=None,
                   help=f"0 = greedy (default {d['temperature']:g})")
    g.add_argument("--top-k", type=_int_at_least(0), default=None, help=f"0 = off (default {d['top_k']})")
    g.add_argument("--top-p", type=float, default=None, help=f"1 = off (default {d['top_p']:g})")
    g.add_argument("--min-p", type=float, default=None, help=f"0 = off (default {d['min_p']:g})")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"1 = off (default {d['repetition_penalty']:g})")
    g.add_argument("--seed", type=_int_at_least(0), default=None, help="sampling seed (default: random)")
    g.add_argument(
        "--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)"
    )


def _add_chat_mode(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="wrap the prompt in the model's chat template (default when it has one)")  # fmt: skip
    g.add_argument("--raw", dest="chat", action="store_false", help="send the prompt as is")
    p.add_argument("--system", default=None, help="system message (chat template only)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="exl2cpp: run Llama-family models (fp16 and EXL2) without torch.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("run", help="generate a reply to one prompt, streamed to stdout",
                       usage=f"{PROG} run [options] [MODEL] PROMPT",
                       description="Generate from PROMPT. With one positional it is the prompt and the "
                                   "model is the default (smollm2). PROMPT '-' reads stdin.")  # fmt: skip
    p.add_argument("args", nargs="+", metavar="[MODEL] PROMPT")
    _add_model_options(p)
    _add_sampling_options(p, RUN_DEFAULTS, "greedy unless --temperature > 0")
    _add_chat_mode(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive chat using the model's chat template")
    p.add_argument(
        "model", nargs="?", default=None, help="folder, .gguf or alias (default: smollm2)"
    )
    _add_model_options(p)
    _add_sampling_options(p, API_DEFAULTS, "defaults: the Python API's")
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("ppl", help="perplexity of a text file")
    p.add_argument("model")
    p.add_argument("file", help="UTF-8 text file ('-' for stdin)")
    p.add_argument("--ctx", type=_int_at_least(2), default=2048,
                   help="tokens per evaluation window (default 2048, at most the model's context)")
    p.add_argument("--max-tokens", type=_int_at_least(2), default=None,
                   help="use only the first N tokens of the file (default: all)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar (there is none when stderr is not "
                   "a terminal)")
    _add_model_options(p)
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("info", help="describe a model (architecture, sizes, memory)")
    p.add_argument("model")
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_model_options(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the 'server' extra)",
                       description="Serve MODEL over an OpenAI-compatible HTTP API (see docs/server.md). "
                                   "Keys also come from $EXL2CPP_API_KEYS (comma-separated) and "
                                   "$EXL2CPP_ADMIN_KEY.")  # fmt: skip
    p.add_argument("model", nargs="?", default=None, help="folder, .gguf or alias (default: smollm2)")
    p.add_argument("--config", default=None, metavar="serve.yml", help="YAML settings (flags win)")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY", help="accepted key (repeatable)")
    p.add_argument("--api-key-file", action="append", default=None, metavar="FILE",
                   help="file of accepted keys, one per line")
    p.add_argument("--admin-key", default=None, metavar="KEY", help="key for /admin/* endpoints")
    p.add_argument("--model-name", default=None, help="model id reported by /v1/models")
    p.add_argument("--cache-tokens", type=int, default=None,
                   help="KV-cache size in tokens (default: 90%% of free GPU memory on CUDA; on the CPU the model's "
                        "context, 4096 to 32768)")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="rows per forward step (default 2048)")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per cache page, the unit of prefix sharing (default 256)")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens when a request gives none (default 512)")
    p.add_argument("--log-level", default=None, choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--device", type=_device, default=None, help='"cpu" (default), "cuda" or "cuda:N"')
    p.add_argument("--gpu-split", type=_gpu_split, default=None, metavar="GB,GB|auto",
                   help='split the layers across GPUs (with --device cuda): GB per GPU such as "20,24", or "auto"')
    p.add_argument("--tensor-parallel", type=_tensor_parallel, default=None, metavar="all|N|GPU,GPU",
                   help='split every layer across GPUs (heads and MLP columns, NCCL): "all" visible GPUs, N ranks, '
                        'or CUDA indices such as "0,1" (with --device cpu: N virtual ranks, for testing)')
    p.add_argument("--max-seq-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="speculative decoding: a draft model (folder, .gguf or alias) of the same tokenizer")
    p.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                   help="draft tokens per step and job (default 4; adaptive below that)")
    p.add_argument("--ngram-draft", action="store_true", default=None,
                   help="speculative decoding with n-gram (prompt lookup) drafts")
    p.add_argument("--max-body-size", type=int, default=None, metavar="BYTES",
                   help="largest request body, 413 above (default 8388608)")
    p.add_argument("--timeout-header", type=float, default=None, metavar="S",
                   help="seconds a client has for a request's line and headers (default 10)")
    p.add_argument("--timeout-body", type=float, default=None, metavar="S",
                   help="seconds a client has for a request's body, 408 after (default 60)")
    p.add_argument("--timeout-keep-alive", type=float, default=None, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default 5)")
    p.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="open connections; one more is answered 503 and closed (default 512)")
    p.add_argument("--forwarded-allow-ips", default=None, metavar="IP,NET|*",
                   help="proxies whose X-Forwarded-For/-Proto are trusted (default: none)")
    p.add_argument("--timeout-graceful-shutdown", type=float, default=None, metavar="S",
                   help="on SIGTERM, seconds running requests have to finish before they are ended (default 20)")
    p.add_argument("--cache-type", default=None, choices=["auto", "fp16", "fp32", "q8", "q6", "q4"],
                   help="KV-cache storage (default auto: fp32 on CPU, fp16 on CUDA; q8/q6/q4 quantized)")
    p.add_argument("--inline-model-loading", action="store_true", default=None,
                   help="a request's model from --model-dir is loaded when it is not the one serving (admin key)")
    p.add_argument("--idle-unload", type=float, default=None, metavar="S",
                   help="unload the model after S seconds without requests; the next request loads it again")
    p.add_argument("--reasoning", default=None, choices=["auto", "on", "off"],
                   help="split <think>...</think> into reasoning_content (auto: when the model names its markers)")
    p.add_argument("--tool-format", default=None, choices=["auto", "hermes", "llama3", "mistral"],
                   help="tool-call format (default auto: the one the chat template writes, else hermes)")
    p.add_argument("--model-dir", default=None, metavar="DIR",
                   help="folder of models, one per sub-folder (TabbyAPI's /v1/model/list and /v1/model/load)")
    p.add_argument("--sampler-preset", default=None, metavar="NAME",
                   help="sampler override preset to start with (NAME.yml in --sampler-override-dir)")
    p.add_argument("--sampler-override-dir", default=None, metavar="DIR",
                   help="folder of sampler override presets (default: sampler_overrides)")
    p.add_argument("--templates-dir", default=None, metavar="DIR",
                   help="folder of prompt templates, NAME.jinja (default: templates)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("import-gguf", help="convert a llama/qwen2/gemma3 GGUF into an HF-style folder")
    p.add_argument("gguf", metavar="IN.gguf")
    p.add_argument("out_dir", metavar="OUT_DIR", help="folder to write: new or empty")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="storage type of the dequantized tensors (default float16)")
    p.set_defaults(func=cmd_import_gguf)

    p = sub.add_parser("convert", help="quantize an fp16/bf16 HF model into EXL2 at any average bitrate",
                       description="Measure, allocate and GPTQ-quantize IN_DIR into an EXL2 folder OUT_DIR.")  # fmt: skip
    p.add_argument("in_dir", metavar="IN_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--bits", "-b", type=_positive_float, default=None,
                   help="target average bits per weight of the decoder (overhead included)")  # fmt: skip
    p.add_argument("--fit", default=None, metavar="VRAM",
                   help="instead of --bits: the highest bpw that fits VRAM (e.g. 24GiB) at --ctx/--cache (exl2cpp fit)")
    p.add_argument("--ctx", type=int, default=4096, help="with --fit: context per sequence (default 4096)")
    p.add_argument("--cache", default="fp16", choices=["fp16", "q8", "q6", "q4"], help="with --fit: KV cache type")
    p.add_argument("--gpus", type=int, default=1, help="with --fit: GPUs of VRAM each (default 1)")
    p.add_argument("--head-bits", type=int, default=6, choices=[2, 3, 4, 5, 6, 8], metavar="{2,3,4,5,6,8}",
                   help="lm_head bits (default 6)")
    p.add_argument("--calibration", "-c", action="append", default=None, metavar="FILE",
                   help="calibration text: .txt, .jsonl (text field) or .parquet (repeatable; "
                        "default: built-in mix, no download)")  # fmt: skip
    p.add_argument("--rows", type=_int_at_least(1), default=None, help="calibration rows (default: 100 on CUDA, fewer when the "
                   "states would not fit in 60%% of free GPU memory; 32 on the CPU)")
    p.add_argument("--length", type=_int_at_least(16), default=None,
                   help="tokens per calibration row (default 2048 on CUDA, 512 on the CPU or when "
                        "memory is short; at most the model's context)")  # fmt: skip
    p.add_argument("--measure-rows", type=_int_at_least(1), default=None,
                   help="rows used to measure (default 16 on CUDA, 8 on the CPU; at most --rows)")  # fmt: skip
    p.add_argument("--measurement", "-m", default=None, metavar="M.json",
                   help="reuse a measurement.json (ours or ExLlamaV2's) instead of measuring")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="calibration sampling seed (default 0)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in OUT_DIR")
    p.add_argument("--shard-size", type=_positive_float, default=8192, help="largest output file, MB (default 8192)")
    p.add_argument("--workers", type=_int_at_least(1), default=None,
                   help="processes for GPTQ (default: CPU count, at most 16)")  # fmt: skip
    p.add_argument("--device", type=_device, default=None,
                   help="cpu, cuda or cuda:N (default: cuda when a GPU is present, else cpu)")  # fmt: skip
    p.add_argument("--rotate", action="store_true",
                   help="fold the norms and rotate the residual stream (Hadamard) before quantizing (Llama, Mistral, "
                        "Qwen2, Qwen3; off by default: it measured worse)")  # fmt: skip
    p.add_argument("--rotate-vo", action="store_true",
                   help="rotate each attention layer's value heads (v_proj / o_proj) before quantizing")
    p.add_argument("--gptq-damp", type=float, default=None, metavar="D",
                   help="GPTQ relative damping, > 0 (default 0.12; with --resume: the interrupted run's)")
    p.add_argument("--alloc-outlier-k", type=float, default=None, metavar="K",
                   help="allocation outlier threshold K, 0 (off) or >= 1 (default 8; with --resume: the "
                        "interrupted run's)")  # fmt: skip
    p.add_argument("--scale-search", choices=("hmse", "absmax"), default=None,
                   help="GPTQ group scale search: hmse (Hessian-weighted, per-column codes; the default) or absmax "
                        "(ExLlamaV2's)")  # fmt: skip
    p.add_argument("--alloc-sensitivity", choices=("outlier", "kl"), default="kl",
                   help="how the allocation weighs each block's error: each block's output KL measured alone "
                        "(default; MoE models: outlier) or the outlier-token correction")  # fmt: skip
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    p.add_argument("--verbose", "-v", action="store_true", help="print the time spent per phase at the end")
    p.set_defaults(func=cmd_convert)
    _add_quality_commands(sub)
    return parser


# -- helpers ----------------------------------------------------------------------------------


def _load(model: str | None, args: argparse.Namespace) -> Any:
    import exl2cpp

    from .models import resolve_model

    if not hasattr(exl2cpp, "load"):
        raise UnsupportedError(
            "this build of exl2cpp has no model runtime (exl2cpp.load is missing)"
        )
    path = resolve_model(model)
    kw: dict[str, Any] = {"device": args.device, "max_seq_len": args.max_seq_len}
    if getattr(args, "gpu_split", None) is not None:
        kw["gpu_split"] = args.gpu_split
    if getattr(args, "tensor_parallel", None) is not None:
        from .tensor_parallel import tensor_parallel_kwargs

        kw.update(tensor_parallel_kwargs(args.tensor_parallel))
    return exl2cpp.load(str(path), **kw)


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw = {k: getattr(args, k) for k in _SAMPLING if getattr(args, k, None) is not None}
    if getattr(args, "stop", None):
        kw["stop"] = list(args.stop)
    return kw


def _stream_to_stdout(model: Any, prompt: str, kw: dict[str, Any]) -> str:
    out = sys.stdout
    parts = []
    for chunk in model.stream(prompt, **kw):
        parts.append(chunk)
        out.write(chunk)
        out.flush()
    return "".join(parts)


def _messages(system: str | None, user: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": user})
    return msgs


def _read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise _UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _UsageError(f"{path} is not UTF-8 text ({exc})") from None


# -- commands ---------------------------------------------------------------------------------


def _looks_like_model(arg: str) -> bool:
    """A folder, a .gguf file or a known alias: what `run MODEL` means when the prompt was forgotten."""
    from .models import ALIASES

    return arg.strip().lower() in ALIASES or os.path.isdir(arg) or (arg.endswith(".gguf") and os.path.isfile(arg))


def _check_sampling(args: argparse.Namespace) -> None:
    """Bad sampling values are usage errors (exit 2), found before the model loads."""
    from .engine import _sampler_settings

    kw = {k: v for k, v in _sampling_kwargs(args).items() if k not in ("max_new_tokens", "stop")}
    try:
        _sampler_settings(kw)
    except Exl2Error as exc:
        flag = re.sub(r"SamplerSettings\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(exc))
        raise _UsageError(flag) from None


def cmd_run(args: argparse.Namespace) -> int:
    if len(args.args) == 1:
        model_name, prompt = None, args.args[0]
        if _looks_like_model(prompt):
            raise _UsageError(f"{prompt!r} is a model: give the prompt too, `{PROG} run {prompt} PROMPT` "
                              "('-' reads it from stdin)")  # fmt: skip
    elif len(args.args) == 2:
        model_name, prompt = args.args
    else:
        raise _UsageError(
            f"run takes [MODEL] PROMPT, got {len(args.args)} arguments (quote the prompt)"
        )
    _check_sampling(args)
    if prompt == "-":
        prompt = sys.stdin.read()
    model = _load(model_name, args)
    tok = model.tokenizer
    use_chat = args.chat
    if use_chat is None:
        use_chat = tok.has_chat_template
    if use_chat:
        prompt = tok.apply_chat_template(_messages(args.system, prompt), add_generation_prompt=True)
    elif args.system:
        raise _UsageError("--system needs the chat template (drop --raw)")
    # One-shot answers are deterministic by default (greedy); --temperature > 0 samples.
    kw = _sampling_kwargs(args)
    kw.setdefault("temperature", 0.0)
    _stream_to_stdout(model, prompt, kw)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


def cmd_chat(args: argparse.Namespace, input_fn: Any = None) -> int:
    input_fn = input_fn or input
    _check_sampling(args)
    model = _load(args.model, args)
    tok = model.tokenizer
    if not tok.has_chat_template:
        raise _UsageError(
            f"{args.model or 'the model'} has no chat template; use `exl2cpp run --raw` instead"
        )
    kw = _sampling_kwargs(args)
    history: list[dict[str, str]] = (
        [{"role": "system", "content": args.system}] if args.system else []
    )
    interactive = sys.stdin.isatty()
    if interactive:
        print("exl2cpp chat: /reset clears the history, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input_fn("> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = history[:1] if args.system else []
            print("(history cleared)", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        prompt = tok.apply_chat_template(history, add_generation_prompt=True)
        reply = _stream_to_stdout(model, prompt, kw)
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": reply.strip()})


def cmd_ppl(args: argparse.Namespace) -> int:
    text = _read_text(args.file)
    model = _load(args.model, args)
    kw: dict[str, Any] = {"ctx": args.ctx, "max_tokens": args.max_tokens}
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="perplexity", unit="tok", file=sys.stderr, dynamic_ncols=True,
                       disable=args.quiet or not sys.stderr.isatty())  # fmt: skip
        bar.update(done - bar.n)

    try:
        ppl = model.perplexity(text, progress=progress, **kw)
    finally:
        if bar is not None:
            bar.close()
    print(f"perplexity: {ppl:.4f} (ctx {args.ctx})")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    model = _load(args.model, args)
    info = model.info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    width = max((len(str(k)) for k in info), default=0)
    for key, value in info.items():
        text = _summary(value)
        if key.endswith("_bytes") and isinstance(value, int):
            text = f"{value} ({value / 2**20:.1f} MiB)"
        print(f"{key!s:<{width}}  {text}")
    return 0


def _summary(value: Any) -> str:
    """One readable line for an info() value; long lists (per-linear rows) are summarized."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        kinds: dict[str, int] = {}
        for row in value:
            label = str(row.get("bits", row.get("kind", "?")))
            kinds[label] = kinds.get(label, 0) + 1
        parts = ", ".join(f"{k} x{n}" for k, n in kinds.items())
        return f"{len(value)} ({parts}; --json lists them)"
    if isinstance(value, list) and len(value) > 8 and all(isinstance(v, str) for v in value):
        runs: list[list] = []  # e.g. layer_devices: "cuda:0 x16, cuda:1 x16"
        for v in value:
            if runs and runs[-1][0] == v:
                runs[-1][1] += 1
            else:
                runs.append([v, 1])
        return ", ".join(f"{v} x{n}" for v, n in runs)
    if value is None or (isinstance(value, (list, dict)) and not value):
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_summary(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {_summary(v)}" for k, v in value.items())
    return str(value)


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client", "llguidance", "yaml")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise _UsageError(f"the server needs extra packages ({', '.join(missing)} missing): "
                          "pip install 'exl2cpp[server]'")
    from .errors import InvalidArgumentError
    from .server import load_config, serve

    try:
        cfg = _serve_config(load_config, args)
    except InvalidArgumentError as exc:  # a flag, a serve.yml value or a key file: usage errors
        raise _UsageError(str(exc)) from None
    serve(cfg)
    return 0


def _serve_config(load_config, args: argparse.Namespace):
    return load_config(
        args.config, model=args.model, host=args.host, port=args.port, api_keys=args.api_key,
        api_key_files=args.api_key_file, admin_key=args.admin_key, model_name=args.model_name,
        device=args.device, gpu_split=args.gpu_split, tensor_parallel=args.tensor_parallel,
        max_seq_len=args.max_seq_len, cache_tokens=args.cache_tokens,
        max_batch_tokens=args.max_batch_tokens, page_size=args.page_size,
        draft_model=args.draft_model, draft_tokens=args.draft_tokens, ngram_draft=args.ngram_draft,
        default_max_tokens=args.default_max_tokens, log_level=args.log_level,
        max_body_size=args.max_body_size, timeout_header=args.timeout_header, timeout_body=args.timeout_body,
        timeout_keep_alive=args.timeout_keep_alive, max_connections=args.max_connections,
        forwarded_allow_ips=args.forwarded_allow_ips, timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        model_dir=args.model_dir, sampler_preset=args.sampler_preset, sampler_override_dir=args.sampler_override_dir,
        templates_dir=args.templates_dir, cache_type=args.cache_type, inline_model_loading=args.inline_model_loading,
        idle_unload_s=args.idle_unload, reasoning={"on": True, "off": False}.get(args.reasoning, args.reasoning),
        tool_format=args.tool_format,
    )


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from .gguf_import import import_gguf

    out = import_gguf(args.gguf, args.out_dir, dtype=args.dtype)
    print(f"imported {args.gguf} -> {out}", file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from . import convert as conv

    if (args.bits is None) == (args.fit is None):
        raise _UsageError("give --bits BPW or --fit VRAM (one of them)")
    try:  # the library's own checks of the plain values, as usage errors before any work
        conv._check_args(args.bits if args.bits is not None else 4.0, args.head_bits, args.rows or 1,
                         args.length or 512, args.measure_rows, args.shard_size, 1.0, args.seed, args.gptq_damp,
                         args.alloc_outlier_k)  # fmt: skip
    except Exl2Error as exc:
        raise _UsageError(str(exc)) from None
    bits = args.bits
    if args.fit is not None:
        from .budget import fit_bpw, format_fit

        r = fit_bpw(args.in_dir, _size_arg(args.fit), ctx=_positive(args.ctx, "--ctx"), cache=args.cache,
                    gpus=_positive(args.gpus, "--gpus"), head_bits=args.head_bits)
        print(format_fit(r), file=sys.stderr)
        if r["bpw"] is None:
            raise OutOfMemoryError(f"{args.in_dir} does not fit {args.fit} at ctx {args.ctx} even at 2.0 bpw")
        bits = r["bpw"]
    out = conv.convert(args.in_dir, args.out_dir, bits=bits, head_bits=args.head_bits,
                       calibration=args.calibration, rows=args.rows, length=args.length,
                       measure_rows=args.measure_rows, measurement=args.measurement, seed=args.seed,
                       resume=args.resume, shard_size=args.shard_size, workers=args.workers,
                       progress=not args.quiet, device=args.device, verbose=args.verbose, rotate=args.rotate,
                       rotate_vo=args.rotate_vo, gptq_damp=args.gptq_damp,
                       alloc_outlier_k=args.alloc_outlier_k, alloc_sensitivity=args.alloc_sensitivity,
                       scale_search=args.scale_search)  # fmt: skip
    print(f"converted {args.in_dir} -> {out}", file=sys.stderr)
    return 0


# -- compare and fit ----------------------------------------------------------------------------


def _add_quality_commands(sub) -> None:
    p = sub.add_parser("compare", help="quality of quants side by side: perplexity, KL, top-1 agreement, size, speed",
                       description="Score every MODEL on the same tokens against --reference (default: the first "
                                   "model): perplexity, mean KL divergence, top-1 agreement, the worst windows, "
                                   "bpw, file size, memory after load and (on a GPU) prefill and decode tok/s.")
    p.add_argument("models", nargs="+", metavar="MODEL", help="model folders (quants of one model)")
    p.add_argument("--reference", default=None, metavar="FP16_DIR", help="the model to compare against")
    p.add_argument("--text", action="append", default=None, metavar="FILE",
                   help="UTF-8 text to score (repeatable; default: the GPL-3 text in /usr/share/common-licenses)")
    p.add_argument("--ctx", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    p.add_argument("--device", default="cpu", help='"cpu" (default), "cuda" or "cuda:N"')
    p.add_argument("--json", action="store_true", help='print {"models": [...]} as JSON')
    p.add_argument("--plot", default=None, metavar="OUT.png", help="draw KL and perplexity against bpw (matplotlib)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("fit", help="what fits a GPU: the highest bpw for an fp16 model, or a quant's largest context",
                       description="fp16 MODEL: the highest bpw (0.05 steps) whose weights, KV cache, working "
                                   "buffers and CUDA context fit --vram. EXL2 MODEL: whether it fits, and the "
                                   "largest context per cache type.")
    p.add_argument("model", metavar="MODEL_OR_QUANT")
    p.add_argument("--vram", required=True, help="memory per GPU, e.g. 24GiB, 80GB, 16000MiB")
    p.add_argument("--gpus", type=int, default=1, help="GPUs of --vram each, filled in order (default 1)")
    p.add_argument("--ctx", type=int, default=4096, help="context per sequence (default 4096)")
    p.add_argument("--cache", default="fp16", choices=["fp16", "q8", "q6", "q4"], help="KV cache type (default fp16)")
    p.add_argument("--batch", type=int, default=1, help="sequences of --ctx tokens (default 1)")
    p.add_argument("--head-bits", type=int, default=6, choices=[2, 3, 4, 5, 6, 8],
                   help="lm_head bits of the conversion (default 6)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_fit)


def _positive(value: int, name: str) -> int:
    if value < 1:
        raise _UsageError(f"{name} must be a positive integer, got {value}")
    return value


def _size_arg(text: str) -> int:
    from .budget import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def cmd_compare(args: argparse.Namespace) -> int:
    from .quality import compare, format_table, plot

    if args.ctx < 2:
        raise _UsageError(f"--ctx must be at least 2, got {args.ctx}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise _UsageError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    if args.plot is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise _UsageError("--plot needs matplotlib: pip install 'exl2cpp[plot]'")
    texts = args.text
    for t in texts or []:
        if not os.path.isfile(t):
            raise _UsageError(f"cannot read {t}: no such file")
    from .models import resolve_model

    models = [str(resolve_model(m)) for m in args.models]
    ref = str(resolve_model(args.reference)) if args.reference else None
    result = compare(models, reference=ref, texts=texts, ctx=args.ctx, device=args.device, max_tokens=args.max_tokens,
                     progress=not args.quiet)
    if args.plot is not None:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    from .budget import fit, format_fit

    vram = _size_arg(args.vram)
    r = fit(args.model, vram, ctx=_positive(args.ctx, "--ctx"), cache=args.cache, gpus=_positive(args.gpus, "--gpus"),
            batch=_positive(args.batch, "--batch"), head_bits=args.head_bits)
    print(json.dumps(r, indent=2) if args.json else format_fit(r))
    return 0


def _discard_stdout() -> None:
    """Point stdout's file descriptor at /dev/null: what is still buffered for a closed pipe goes nowhere instead
    of failing again (a second BrokenPipeError message) when the interpreter flushes it at exit."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError):  # not a real file (io.UnsupportedOperation is a ValueError)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


# -- entry point ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 1 error, 2 usage, 130 interrupted, 143 SIGTERM)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    old_term = None
    if args.command != "serve" and threading.current_thread() is threading.main_thread():
        old_term = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return int(args.func(args) or 0)
    except _UsageError as exc:
        parser.exit(2, f"{PROG} {args.command}: error: {exc}\n")
    except BrokenPipeError:  # `exl2cpp run ... | head`: the reader has what it wanted
        _discard_stdout()
        return 0
    except (Exl2Error, OSError) as exc:
        sys.stdout.flush()
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(file=sys.stderr)
        return 130
    except _Terminated:
        return 143
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    return 0  # unreachable; keeps type checkers happy


if __name__ == "__main__":
    sys.exit(main())
