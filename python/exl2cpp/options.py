"""Runtime options: the typed registry of every choice that used to be an ``EXL2CPP_*`` environment switch.

The registry lives in C++ (``cpp/include/exl2/options.h``); this module reads and sets it and renders the doc page
``docs/options.md`` (``python -m exl2cpp.options`` prints it; tests check that the page matches).

    >>> import exl2cpp
    >>> model = exl2cpp.load(folder, device="cuda", options={"cuda_graphs": False})
    >>> with exl2cpp.options.scope(gemv_fuse=False):   # tests sweep options this way
    ...     model.generate("Hi", max_new_tokens=4)

Options are process-wide: ``load(options=...)`` and ``Engine(options=...)`` set them for what follows (loaders read
the ``load`` ones while loading, kernels the ``matmul`` / ``step`` ones at launch, caches the ``kv_cache`` ones when
they are made; a CUDA graph keeps what it captured).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from . import _C
from .errors import InvalidArgumentError

__all__ = ["get", "set", "defaults", "registry", "scope", "parse_assignments", "markdown", "warn_retired_environment"]


def get() -> dict[str, Any]:
    """The options in force, name -> bool / int / str."""
    return _C.get_options()


def set(options: Mapping[str, Any] | None = None, **kw: Any) -> None:  # noqa: A001 (the module's verb)
    """Set some options by name; the others keep their values. InvalidArgumentError for an unknown name or a bad
    value (nothing changes then)."""
    merged = dict(options or {})
    merged.update(kw)
    _C.set_options(merged)


def defaults() -> dict[str, Any]:
    """The options' defaults."""
    return _C.default_options()


def registry() -> list[dict[str, str]]:
    """Every option: name, type, default, allowed, scope, doc (as text)."""
    return _C.option_registry()


@contextlib.contextmanager
def scope(options: Mapping[str, Any] | None = None, **kw: Any) -> Iterator[dict[str, Any]]:
    """Set options for a ``with`` block, restoring the previous ones at its end."""
    saved = get()
    set(options, **kw)
    try:
        yield get()
    finally:
        _C.set_options(saved)


def parse_assignments(items: Iterable[str]) -> dict[str, str]:
    """``NAME=VALUE`` texts (a driver's repeated ``--option`` flags) as {name: value text}, checked against the
    registry without changing the options in force: InvalidArgumentError naming the text without ``=``, the unknown
    name or the bad value. A later text for the same name wins."""
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = str(item).partition("=")
        if not eq or not name.strip():
            raise InvalidArgumentError(f"option {item!r}: expected NAME=VALUE (docs/options.md lists the names)")
        out[name.strip()] = value.strip()
    with scope(out):  # the registry's own checks
        pass
    return out


def markdown() -> str:
    """The doc page docs/options.md, generated from the registry."""
    lines = [
        "# Options",
        "",
        "Generated from `cpp/include/exl2/options.h` by `python -m exl2cpp.options` (tests/test_options.py checks",
        "that this page matches). Options are typed fields of the runtime's settings, passed as parameters:",
        "`exl2cpp.load(..., options={...})`, `Engine(model, options={...})`, `exl2cpp.options.scope(...)` in tests,",
        "`exl2::set_runtime_options()` from C++. No environment variable picks a code path. The converter's",
        "settings are parameters of `exl2cpp.convert(...)` and flags of `exl2cpp convert` (docs/convert.md,",
        "docs/cli.md).",
        "",
        "| option | type | default | allowed | read by | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for o in registry():
        allowed = o["allowed"].replace("|", ", ") if o["type"] != "bool" else "true, false"
        lines.append(f"| `{o['name']}` | {o['type']} | `{o['default']}` | {allowed} | {o['scope']} | {o['doc']} |")
    lines += [
        "",
        "## Environment settings",
        "",
        "Configuration that stays in the environment (no code path depends on it):",
        "",
        "| variable | what it sets |",
        "|---|---|",
    ]
    for name, doc in _C.environment_settings():
        lines.append(f"| `{name}` | {doc} |")
    lines += [
        "",
        "## Former environment switches",
        "",
        "| variable | now |",
        "|---|---|",
    ]
    for name, now in _FORMER:
        lines.append(f"| `{name}` | {now} |")
    return "\n".join(lines) + "\n"


# Where each former EXL2CPP_* switch went (measurements: dev/kernels/exl2_gemv_notes.md, bench/results/).
_FORMER = [
    ("EXL2CPP_GEMV", "removed: v4 ships; main's tiled layout (286 against 328 tok/s, H200) and v4k (326.9) are "
     "variants 01 / 02 and exl2_gemv_main_layout.h in dev/kernels/"),
    ("EXL2CPP_GEMV_L1", "removed: the L1 prefetch variant lost (435 against 453 tok/s of linears, H200)"),
    ("EXL2CPP_GEMV_CLUSTER", "removed: cluster split-k lost (-5% end to end, H200)"),
    ("EXL2CPP_GEMV_PDL", "removed: the v4 GEMV follows option `pdl`"),
    ("EXL2CPP_ATTN_PREFILL", "removed: rm2 ships for head_dim 64 / 128 (211 against 153 TFLOP/s, H200)"),
    ("EXL2CPP_EXL2_GEMM_THRESHOLD", "option `gemv_max_rows`"),
    ("EXL2CPP_GEMV_GROUP", "option `gemv_group`"),
    ("EXL2CPP_GEMV_FUSE", "option `gemv_fuse`"),
    ("EXL2CPP_GEMV_M32", "option `gemv_m32`"),
    ("EXL2CPP_GEMV_SLICES", "option `gemv_slices`"),
    ("EXL2CPP_GEMV_CHUNKS", "option `gemv_chunks`"),
    ("EXL2CPP_GEMV_BLOCKS_PER_SM", "option `gemv_blocks_per_sm`"),
    ("EXL2CPP_GEMV_PREFETCH", "option `gemv_prefetch`"),
    ("EXL2CPP_GEMV_AHEAD", "option `gemv_prefetch_ahead`"),
    ("EXL2CPP_PDL", "option `pdl`"),
    ("EXL2CPP_CUDA_GRAPHS", "option `cuda_graphs`"),
    ("EXL2CPP_CUDA_REF", "option `cuda_reference`"),
    ("EXL2CPP_SYNC_CHECK", "option `sync_check`"),
    ("EXL2CPP_DEVICE_ARGMAX", "option `device_argmax`"),
    ("EXL2CPP_DEVICE_SAMPLE", "option `device_sample`"),
    ("EXL2CPP_KVQ_KCENTRE", "option `kv_k_centre`"),
    ("EXL2CPP_KVQ_SINK", "option `kv_sink`"),
    ("EXL2CPP_WEIGHT_ARENA", "option `weight_arena`"),
    ("EXL2CPP_TP_THREADS", "option `tp_threads`"),
    ("EXL2CPP_TP_GRAPHS", "option `tp_graphs`"),
    ("EXL2CPP_TP_TRACE", "option `tp_trace`"),
    ("EXL2CPP_TP_TEST_FAIL_RANK", "option `tp_test_fail_rank`"),
    ("EXL2CPP_CPU_ACT", "option `cpu_activations`"),
    ("EXL2CPP_GPTQ_ROWLOOP", "option `gptq_rowloop_smem`"),
    ("EXL2CPP_GPTQ_DAMP", "`convert(gptq_damp=...)`, `exl2cpp convert --gptq-damp`"),
    ("EXL2CPP_ALLOC_OUTLIER", "`convert(alloc_outlier_k=...)`, `exl2cpp convert --alloc-outlier-k`"),
    ("EXL2CPP_CONVERT_TIMING", "`convert(verbose=True)`, `exl2cpp convert --verbose`"),
]
# The former switches each entry point warns about when they are still set (they are no longer read).
_FORMER_BY_USE = {"convert": ("EXL2CPP_GPTQ_DAMP", "EXL2CPP_ALLOC_OUTLIER", "EXL2CPP_CONVERT_TIMING")}


def warn_retired_environment(use: str | None = None) -> list[str]:
    """Warn (UserWarning) about each former switch set in the environment, naming what replaced it: those of entry
    point ``use`` ("convert"), or all of them. Returns the names found."""
    now = dict(_FORMER)
    names = _FORMER_BY_USE[use] if use is not None else tuple(now)
    found = [n for n in names if os.environ.get(n)]
    for n in found:
        warnings.warn(f"{n} is no longer read; use {now[n]} (docs/options.md)", UserWarning, stacklevel=3)
    return found


if __name__ == "__main__":
    print(markdown(), end="")
