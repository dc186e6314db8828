"""``exl2cpp.convert``: quantize an fp16/bf16/fp32 HF model of any architecture the runtime runs into EXL2 at any
average bitrate.

    >>> from exl2cpp.convert import convert
    >>> convert("SmolLM2-135M", "SmolLM2-135M-4.65bpw", bits=4.65)

Pipeline (each pass has a progress bar; state is saved per layer in OUT_DIR/.convert_state so ``resume=True``
continues an interrupted run and writes byte-identical files):
calibration rows -> measurement (GPTQ per candidate config per block, block output error) -> outlier scales
(one clean forward: how much outlier tokens deflate each block's relative error) -> allocation (one config per
block, average bpw with overhead <= target, within a group's bits of it) -> quantization (sequential GPTQ on the
quantized model's states, lm_head at head_bits) -> output-*.safetensors + config.json.
The calibration forward is the runtime's own decoder body (``_C.Calibration``, fp32, one layer at a time, the
states resident on the device; capture hooks report each linear's input), so the converter holds no model code of
its own. GPTQ runs in C++ (``_C.gptq_quantize``); with ``device="cuda"`` (the default when a GPU is present) the
forward, the Hessians and GPTQ run on our CUDA backend.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .. import __version__
from ..errors import InvalidArgumentError, ModelFileError
from ..options import warn_retired_environment
from . import allocate as alloc
from .calibration import build_calibration
from .gptq import DAMP, SCALE_SEARCH, check_damp, check_search
from .measure import (
    KL_REF_BPW,
    block_scales,
    kl_scales,
    kl_sensitivity,
    measure_layer,
    OUTLIER_K,
    check_outlier_k,
    measure_steps,
    quantize_head,
    quantize_layer,
)
from .pool import GPTQPool, default_workers
from .progress import bar
from .qparams import QParams
from .source import SourceModel
from .timing import timer

__all__ = ["convert"]

STATE_DIR = ".convert_state"
ALLOC_SENSITIVITIES = ("outlier", "kl")  # convert(alloc_sensitivity=)
# Default calibration (rows, tokens per row, rows used by the measurement) per device kind. On CUDA ExLlamaV2
# 0.3.2's amount, 100 x 2048 measuring 16: on the H200 (SmolLM2-135M) it lowered KL to fp16 by 17-38 % at
# 3.0-6.0 bpw against 32 x 512 (docs/convert.md, "Calibration size"), at ~4x the conversion time. Its CUDA layer
# states are ~47 GB for an 8B model, so calibration_size takes fewer rows (then 512 tokens) when they would not
# fit in STATE_MEMORY_FRACTION of the GPU's free memory. The CPU keeps 32 x 512 (tiny models, CI). A default length
# is capped by the model's max_position_embeddings.
CALIBRATION_DEFAULTS = {"cpu": (32, 512, 8), "cuda": (100, 2048, 16)}
CALIBRATION_FLOOR = (32, 512, 8)  # the smallest default on CUDA when memory is short
STATE_MEMORY_FRACTION = 0.6
# Test hook: called as _test_hook(phase, layer, where) inside the passes ("measure"/"quant"); raising from it
# simulates an interrupted run.
_test_hook: Callable[[str, int, str], None] | None = None


def _hook(phase: str, layer: int, where: str) -> None:
    if _test_hook is not None:
        _test_hook(phase, layer, where)


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def _atomic_npy(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, arr)
    tmp.replace(path)


def _save_tensors(path: Path, tensors: dict) -> None:
    from .writer import save_safetensors

    save_safetensors(tensors, path)


def _load_tensors(path: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(path))


def convert(in_dir: str | os.PathLike, out_dir: str | os.PathLike, bits: float, head_bits: int = 6,
            calibration: list[str] | str | None = None, rows: int | None = None, length: int | None = None,
            measure_rows: int | None = None, measurement: str | os.PathLike | None = None, seed: int = 0,
            resume: bool = False, shard_size: float = 8192, error_norm: float = 2.0,
            workers: int | None = None, progress: bool = True, device: str | None = None, verbose: bool = False,
            timing_file: str | os.PathLike | None = None, rotate: bool = False, rotate_vo: bool = False,
            gptq_damp: float | None = None, alloc_outlier_k: float | None = None, alloc_sensitivity: str = "kl",
            scale_search: str | None = None) -> Path:  # fmt: skip
    """Convert the HF model folder ``in_dir`` into an EXL2 model folder ``out_dir``.

    Parameters
    ----------
    bits
        Target average bits per weight of the decoder linears (EXL2 overhead included, as ``Model.info()``'s
        ``bpw_layers`` counts it); the result lands at most 0.02 below it (MoE layers: one config serves every expert,
        so the last promotions step by a group of all of them: further below on tiny models). The head is separate
        (head_bits).
    head_bits
        lm_head bit width: 2, 3, 4, 5, 6 or 8.
    calibration
        Text files (.txt, .jsonl with a "text" field, .parquet with pyarrow); default: a mix that needs no
        download (see :mod:`exl2cpp.convert.calibration`).
    rows, length, measure_rows
        Calibration rows and tokens per row; measurement uses the first ``measure_rows`` rows. Defaults
        (CALIBRATION_DEFAULTS, per device kind): on CUDA 100 rows x 2048 tokens measuring on 16 (ExLlamaV2
        0.3.2's amount; fewer rows, then 512 tokens, when the layer states would not fit in 60% of the free GPU
        memory), on the CPU 32 x 512 measuring on 8. The length is at most the model's max_position_embeddings,
        measure_rows at most rows. The values used go into quantization_config.
    measurement
        A measurement.json from an earlier run (ours or ExLlamaV2's) to skip the measurement pass. Ours also
        carries its calibration rows: a run with the same calibration arguments (files, rows, length, seed) reuses
        them instead of building them again (the model-generated rows take one sampled decode per token).
    seed
        Seeds the calibration (model-generated text, row order); the output is a function of the inputs and
        the seed.
    resume
        Continue an interrupted run in ``out_dir`` (same arguments; gptq_damp and alloc_outlier_k left None take
        the interrupted run's); the files equal an uninterrupted run's.
    shard_size
        Largest output shard, MB.
    error_norm
        The allocation minimizes sum((scale * block_error) ** error_norm), scale = measure.block_scales' outlier
        correction (alloc_outlier_k=0: 1). 2 (squared relative output errors, which KL follows to first order) gave
        lower KL than 1 at 2.5 and 4.0 bpw on SmolLM2's first 4 layers.
    gptq_damp
        GPTQ's relative damping: gptq_damp x mean(diag H) is added to the Hessian's diagonal (raised until Cholesky
        succeeds). A positive number; None: 0.12 (ExLlamaV2's), or on ``resume`` the interrupted run's. Recorded in
        quantization_config.gptq_damp (docs/convert.md, "Calibration size": 0.01 measured 1-3 % lower KL at 4.0-6.0
        bpw on SmolLM2, unmeasured below).
    alloc_outlier_k
        The allocation's outlier threshold K: a token whose residual norm exceeds K x its row's median token norm is
        an outlier, and each block's error is scaled by how much such tokens deflate it (docs/convert.md,
        "Allocation"). 0 (no weighting: ExLlamaV2's allocation) or a number >= 1; None: 8, or on ``resume`` the
        interrupted run's. Recorded in quantization_config.alloc_outlier_k.
    workers
        Processes for GPTQ on the CPU (default: CPU count, at most 16; 1 = in this process). The output is the
        same for any workers > 1; workers=1 can differ in the last bits (BLAS threading), not in quality.
        Ignored on CUDA (GPTQ runs in this process).
    device
        "cpu", "cuda" or "cuda:N" (default: "cuda" when a CUDA device is present, else "cpu"). GPTQ gives the same
        codes on both for the same inputs; the Hessians and projections (fp32, cuBLAS) differ in rounding, so a
        CUDA and a CPU run are not byte-identical (--resume must use the same device).
    rotate, rotate_vo
        Before quantizing, fold the norms into the linears and rotate the residual stream with a seeded randomized
        Hadamard matrix (rotate), and / or each attention layer's value heads (rotate_vo: v_proj rows, o_proj
        columns), :mod:`exl2cpp.convert.rotate`. The output is a plain checkpoint of the architecture (lm_head
        untied by rotate). Exact only for ROTATABLE architectures (Llama, Mistral, Qwen2, Qwen3): any other is
        converted unrotated, with the reason in the log and in quantization_config.rotation. Off by default: on
        SmolLM2 both raised the KL to fp16 (docs/quality.md, "Rotation").
    scale_search
        GPTQ's group scale search (gptq.SCALE_SEARCHES): "hmse" (the default, gptq.SCALE_SEARCH) minimizes each
        group's squared rounding error weighted per row by GPTQ's 1 / U[r, r]^2 and then picks every column's
        scale code; "absmax" is ExLlamaV2's search. None: the default (with ``resume``: the interrupted run's).
        The files are standard EXL2 either way; the value used goes into quantization_config.gptq_scale_search.
    alloc_sensitivity
        How the allocation weighs each block's measured error: "outlier" (the outlier-token correction,
        measure.block_scales) or "kl" (measure.kl_sensitivity: each block quantized alone at its option nearest 3.0
        bpw, the mean KL of the final logits to the clean model's on the measurement rows; the block's error scale
        is sqrt(KL) / its measured error, so the objective approximates the summed output KL). The "kl" pass
        writes kl_sensitivity.json beside measurement.json and reuses the one beside ``measurement`` when its
        calibration rows match. The default; MoE models take "outlier" (quantization_config.alloc_sensitivity
        says which ran; docs/quality.md, "Scale search and KL allocation").
    verbose, timing_file
        Print the seconds spent per phase (calibration, forward, Hessians, prepare = Cholesky, GPTQ, candidate
        evaluation, transfers, state I/O; see :mod:`exl2cpp.convert.timing`) to stderr at the end (CLI:
        ``--verbose``), and / or write them as JSON to ``timing_file`` (not into OUT_DIR: its files are a function
        of the inputs, so a resumed run writes the same bytes). Neither changes the output nor is recorded in it.
    """
    src_dir = Path(in_dir)
    out = Path(out_dir)
    if isinstance(calibration, (str, os.PathLike)):
        calibration = [str(calibration)]
    calibration = [str(c) for c in calibration] if calibration else None
    _check_args(bits, head_bits, 1 if rows is None else rows, 512 if length is None else length, measure_rows,
                shard_size, error_norm, seed, gptq_damp, alloc_outlier_k)  # fmt: skip
    warn_retired_environment("convert")
    if scale_search is not None:
        check_search(scale_search)
    if alloc_sensitivity not in ALLOC_SENSITIVITIES:
        raise InvalidArgumentError(f"--alloc-sensitivity must be one of {', '.join(ALLOC_SENSITIVITIES)}, "
                                   f"got {alloc_sensitivity!r}")  # fmt: skip
    device = _resolve_device(device)
    workers = default_workers() if workers is None else workers
    if not isinstance(workers, int) or workers < 1:
        raise InvalidArgumentError(f"--workers must be a positive integer, got {workers!r}")
    if not src_dir.is_dir():
        raise ModelFileError(f"convert: input folder {src_dir} does not exist")
    if out.resolve() == src_dir.resolve():
        raise InvalidArgumentError("convert: OUT_DIR must differ from IN_DIR")
    timer.reset()
    t_start = time.perf_counter()
    src = SourceModel(src_dir, device)
    if alloc_sensitivity == "kl" and src.moe and src.moe.get("experts"):
        alloc_sensitivity = "outlier"  # measure.kl_sensitivity handles dense models only
    if device != "cpu":
        workers = 1
    free = None
    if device != "cpu":
        from .. import _C

        free = _C.cuda_mem_info(int(device.split(":")[1]) if ":" in device else 0)[0]
    rows, length, mrows = calibration_size(device, rows, length, measure_rows, src.config["max_position_embeddings"],
                                           state_bytes_per_token(src.config, src.moe), free)
    if length > src.config["max_position_embeddings"] > 0:
        raise InvalidArgumentError(
            f"--length {length} exceeds the model's max_position_embeddings {src.config['max_position_embeddings']}"
        )
    for f in calibration or []:
        if not Path(f).is_file():
            raise ModelFileError(f"calibration file {f} does not exist")
    head_qp = alloc.head_qparams(head_bits)
    _check_bits_reachable(src, bits)
    ext_measurement = _load_measurement(measurement, src) if measurement is not None else None

    state = out / STATE_DIR
    saved = _saved_job(state) if resume else {}
    gptq_damp = check_damp(saved.get("gptq_damp", DAMP) if gptq_damp is None else gptq_damp)
    alloc_outlier_k = check_outlier_k(saved.get("alloc_outlier_k", OUTLIER_K) if alloc_outlier_k is None
                                      else alloc_outlier_k)  # fmt: skip
    scale_search = check_search(saved.get("gptq_scale_search", SCALE_SEARCH) if scale_search is None
                                else scale_search)  # fmt: skip
    job = {
        "source": str(src_dir.resolve()), "bits": bits, "head_bits": head_bits, "calibration": calibration,
        "rows": rows, "length": length, "measure_rows": mrows, "seed": seed, "error_norm": error_norm,
        "measurement": str(Path(measurement).resolve()) if measurement else None, "shard_size": shard_size,
        "workers_gt1": workers > 1, "device": device, "gptq_damp": gptq_damp, "alloc_outlier_k": alloc_outlier_k,
        "gptq_scale_search": scale_search, "rotate": bool(rotate), "rotate_vo": bool(rotate_vo),
        "alloc_sensitivity": alloc_sensitivity, "version": __version__,
    }  # fmt: skip
    rotation = _rotation(src, seed, rotate, rotate_vo)
    if ext_measurement is not None:
        _check_measurement_rotation(measurement, rotation)
    _prepare_out(out, state, job, resume)
    src = _rotated_source(src, state, rotation, progress)

    # -- calibration -------------------------------------------------------------------------------
    bos = src.raw_config.get("bos_token_id")
    bos = bos[0] if isinstance(bos, list) and bos else bos
    bos = bos if isinstance(bos, int) and 0 <= bos < src.vocab else None
    cal_job = {"calibration": [Path(c).name for c in calibration] if calibration else None, "rows": rows,
               "length": length, "seed": seed}  # fmt: skip
    if (state / "calib.npy").is_file():
        ids = np.load(state / "calib.npy")
        cal_info = json.loads((state / "calib.json").read_text())
    else:
        reused = _calibration_from_measurement(measurement, cal_job, src.vocab) if measurement else None
        with timer("calibration"):
            if reused is not None:
                ids, cal_info = reused
            else:
                ids, cal_info = build_calibration(src_dir, calibration, rows, length, seed, src.vocab, bos, progress,
                                                  device)  # fmt: skip
            _atomic_json(state / "calib.json", cal_info)
            _atomic_npy(state / "calib.npy", ids)

    with GPTQPool(workers) as pool:
        # -- measurement ---------------------------------------------------------------------------
        cal = None  # the measurement rows' calibration forward, made when a pass needs it
        if ext_measurement is None:
            cal = src.calibration(mrows, length)
            meas = _measure(src, cal, ids[:mrows], state, pool, progress, gptq_damp, scale_search)
            # ExLlamaV2's layout: module indices embed=0, attn/mlp=1..2L, norm, head; None for unmeasured ones
            norm = src.tensor_names["final_norm"].rsplit(".", 1)[0]
            full = {**meas, f"{norm}.norm": None, f"{src.head_name}.linear": None}
            _atomic_json(out / "measurement.json", {
                "measurement": full, "last_module_idx": 2 * src.n_layers + 2,
                # exl2cpp's additions (ExLlamaV2 reads only the two keys above)
                "calibration": {"job": cal_job, "info": cal_info, "ids": ids.tolist()}, "rotation": rotation,
            })  # fmt: skip
        else:
            meas = ext_measurement

        # -- allocation ----------------------------------------------------------------------------
        if alloc_sensitivity == "kl":
            scales = _kl_scales(src, cal, ids[:mrows], length, meas, state, out, measurement, pool, progress,
                                gptq_damp, scale_search)
        else:
            scales = _block_scales(src, cal, ids[:mrows], length, state, progress, alloc_outlier_k)
        del cal
        strategy = _allocate(src, meas, bits, error_norm, scales)
        _atomic_json(state / "strategy.json", strategy)

        # -- quantization --------------------------------------------------------------------------
        tensors = _quantize(src, ids, length, strategy, head_qp, state, pool, progress, gptq_damp, scale_search)

    # -- output ------------------------------------------------------------------------------------
    qconfig = {
        "quant_method": "exl2",
        "version": f"exl2cpp-{__version__}",
        "bits": bits,
        "head_bits": head_bits,
        "calibration": {**cal_info, "seed": seed, "measure_rows": mrows},
        "bits_layers": round(strategy["bpw"], 4),
        "gptq_damp": gptq_damp,
        "gptq_scale_search": scale_search,
        "alloc_outlier_k": alloc_outlier_k,
        "alloc_sensitivity": alloc_sensitivity,
        "rotation": rotation,
    }
    write_bar = bar(total=1, desc="writing", unit="file", enable=progress)
    from .writer import write_output

    with timer("write"):
        write_output(out, src.path, tensors, shard_size, qconfig)  # the rotated folder's config is untied
    write_bar.update(1)
    write_bar.close()
    shutil.rmtree(state)
    timer.add("total", time.perf_counter() - t_start)
    if timing_file is not None:
        Path(timing_file).write_text(json.dumps({"device": device, "bits": bits, "measured": ext_measurement is None,
                                                 "timing": timer.report()}, indent=1) + "\n")  # fmt: skip
    if verbose:
        print(f"convert timing ({device}, {bits} bpw; nested phases overlap their parents):\n{timer.table()}",
              file=sys.stderr)  # fmt: skip
    return out


def state_bytes_per_token(config: dict, moe: dict | None = None) -> int:
    """Bytes of the calibration forward's fp32 buffers per token on the device (cpp/model/calibration.h: states,
    output, reference and scratch 4 x hidden, q and attention output 2 x q width, k, v and their cache 4 x KV width,
    gate and up 2 x intermediate floats; MoE layers (moe: _C.Calibration.moe) add the router logits, top-k ids
    and weights, per chosen expert its gate, up and down output, the shared expert's gate, up, output and gate
    logit)."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads) * head_dim
    floats = 4 * hidden + 2 * heads * head_dim + 4 * kv + 2 * inter
    if moe and moe.get("experts"):
        k, shared = int(moe["top_k"]), int(moe["shared_intermediate"])
        floats += int(moe["experts"]) + 2 * k + k * (2 * int(moe["intermediate"]) + hidden)
        floats += (2 * shared + hidden + 1) if shared else 0
    return 4 * floats


def calibration_size(device: str, rows: int | None, length: int | None, measure_rows: int | None,
                     max_position: int | None, per_token_bytes: int | None = None,
                     free_bytes: int | None = None) -> tuple[int, int, int]:
    """(rows, length, measure_rows) after the device's defaults (CALIBRATION_DEFAULTS) fill the ones left None:
    a default length is capped by max_position (when known), measure_rows by rows. On CUDA, when per_token_bytes
    and free_bytes are known and neither rows nor length was given, the default shrinks until the states fit in
    STATE_MEMORY_FRACTION of free_bytes: fewer rows at the default length down to CALIBRATION_FLOOR's rows, then
    CALIBRATION_FLOOR's length with as many rows as fit (at least the floor's)."""
    cuda = device != "cpu"
    d_rows, d_length, d_mrows = CALIBRATION_DEFAULTS["cuda" if cuda else "cpu"]
    def cap(n: int) -> int:
        return min(n, max_position or n)

    if cuda and rows is None and length is None and per_token_bytes and free_bytes:
        fit = int(STATE_MEMORY_FRACTION * free_bytes) // per_token_bytes  # tokens that fit
        f_rows, f_length, _ = CALIBRATION_FLOOR
        if d_rows * cap(d_length) > fit:
            if fit // cap(d_length) >= f_rows:
                d_rows = fit // cap(d_length)
            else:
                d_length = f_length
                d_rows = max(f_rows, min(d_rows, fit // cap(f_length)))
    rows = d_rows if rows is None else rows
    if length is None:
        length = cap(d_length)
    return rows, length, min(rows, d_mrows if measure_rows is None else measure_rows)


def _calibration_from_measurement(path, cal_job: dict, vocab: int) -> tuple[np.ndarray, dict] | None:
    """The calibration rows stored in our measurement.json when they were made with the same arguments."""
    try:
        cal = json.loads(Path(path).read_text(encoding="utf-8")).get("calibration")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(cal, dict) or cal.get("job") != cal_job:
        return None
    ids = np.asarray(cal.get("ids"), dtype=np.int64)
    if ids.shape != (cal_job["rows"], cal_job["length"]) or ids.min() < 0 or ids.max() >= vocab:
        return None
    return ids.astype(np.int32), cal["info"]


def _resolve_device(device: str | None) -> str:
    from .. import _C

    n = _C.cuda_device_count()
    if device is None:
        return "cuda" if n > 0 else "cpu"
    if device == "cpu":
        return device
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        idx = 0 if device == "cuda" else device[5:]
        if not str(idx).isdigit():
            raise InvalidArgumentError(f"--device {device!r}: expected cpu, cuda or cuda:N")
        _C.require_cuda_backend(f"--device {device}")
        if int(idx) >= n:
            raise InvalidArgumentError(f"--device {device}: not available ({n} CUDA device(s) visible); use --device cpu")
        return device
    raise InvalidArgumentError(f"--device {device!r}: expected cpu, cuda or cuda:N")


def _check_args(bits, head_bits, rows, length, measure_rows, shard_size, error_norm, seed, gptq_damp=None,
                alloc_outlier_k=None) -> None:
    if not isinstance(bits, (int, float)) or not math.isfinite(bits) or not 2.0 <= bits <= 8.5:
        raise InvalidArgumentError(f"--bits must be a number between 2.0 and 8.5, got {bits!r}")
    if not isinstance(rows, int) or rows < 1:
        raise InvalidArgumentError(f"--rows must be a positive integer, got {rows!r}")
    if not isinstance(length, int) or length < 16:
        raise InvalidArgumentError(f"--length must be an integer >= 16, got {length!r}")
    if measure_rows is not None and (not isinstance(measure_rows, int) or measure_rows < 1):
        raise InvalidArgumentError(f"--measure-rows must be a positive integer, got {measure_rows!r}")
    if not shard_size > 0:
        raise InvalidArgumentError(f"--shard-size must be positive (MB), got {shard_size!r}")
    if not error_norm > 0:
        raise InvalidArgumentError(f"error_norm must be positive, got {error_norm!r}")
    if not isinstance(seed, int):
        raise InvalidArgumentError(f"--seed must be an integer, got {seed!r}")
    if gptq_damp is not None:
        check_damp(gptq_damp)
    if alloc_outlier_k is not None:
        check_outlier_k(alloc_outlier_k)


def _saved_job(state: Path) -> dict:
    """The job.json of the interrupted run in ``state`` ({} when there is none)."""
    f = state / "job.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _prepare_out(out: Path, state: Path, job: dict, resume: bool) -> None:
    if resume and state.is_dir():
        old = json.loads((state / "job.json").read_text()) if (state / "job.json").is_file() else None
        if old != job:
            diff = sorted(k for k in job if (old or {}).get(k) != job[k])
            raise InvalidArgumentError(
                f"--resume: {out} holds a run with different arguments ({', '.join(diff)}); "
                "rerun with the same arguments, or delete the folder to start over"
            )
        return
    if out.exists() and any(out.iterdir()):
        hint = "--resume continues it" if state.is_dir() else "choose an empty or new folder"
        raise InvalidArgumentError(f"convert: output folder {out} is not empty ({hint})")
    state.mkdir(parents=True, exist_ok=True)
    _atomic_json(state / "job.json", job)


def _load_measurement(path, src: SourceModel) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"--measurement {p} does not exist")
    try:
        meas = json.loads(p.read_text(encoding="utf-8"))["measurement"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InvalidArgumentError(f"--measurement {p}: not a measurement.json ({exc})") from None
    for i in range(src.n_layers):
        for key, group in src.groups(i).items():
            if key not in meas or not isinstance(meas[key], list) or not meas[key]:
                raise InvalidArgumentError(
                    f"--measurement {p} has no entries for {key}; it was made for another model "
                    f"(this one has {src.n_layers} layers)"
                )
            for e in meas[key]:
                for d in group:
                    if d["role"] not in e:
                        raise InvalidArgumentError(f"--measurement {p}: {key} entry lacks {d['role']}")
                    QParams.from_json(e[d["role"]])
    return meas


def _rotation(src: SourceModel, seed: int, rotate: bool, vo: bool) -> dict:
    """quantization_config["rotation"] of this run: the rotation when asked and exact for src's architecture
    (rotate.describe), else {"method": None, "reason": why} (printed to stderr when the architecture is why)."""
    if not rotate and not vo:
        return {"method": None, "reason": "off (--rotate / --rotate-vo turn it on)"}
    from .rotate import describe, rotation_reason

    reason = rotation_reason(src)
    if reason is not None:
        print(f"convert: {reason}", file=sys.stderr)
        return {"method": None, "reason": reason}
    return describe(seed, vo, residual=rotate)


def _rotated_source(src: SourceModel, state: Path, rotation: dict, progress: bool) -> SourceModel:
    """The model to quantize: src rotated into state/rotated (made once, kept for --resume) when rotation has a
    method, else src."""
    if rotation["method"] is None:
        return src
    from .rotate import rotate_checkpoint

    rot_dir, done = state / "rotated", state / "rotated.json"
    if not done.is_file() or json.loads(done.read_text()) != rotation:
        shutil.rmtree(rot_dir, ignore_errors=True)
        with bar(total=1, desc="rotation", unit="model", enable=progress) as pb, timer("rotate"):
            info = rotate_checkpoint(src, rot_dir, rotation["seed"], rotation["vo"], rotation["residual"])
            pb.update(1)
        _atomic_json(done, info)
    return SourceModel(rot_dir, src.device)


def _check_measurement_rotation(path, rotation: dict) -> None:
    """A measurement.json of ours records its rotation: refuse one made for another (ExLlamaV2's records none)."""
    made = json.loads(Path(path).read_text(encoding="utf-8")).get("rotation")
    if made is not None and made != rotation:
        raise InvalidArgumentError(
            f"--measurement {path} was made with rotation {made}, this run's is {rotation}; measure again, or pass "
            "the rotation options it was made with"
        )


def _measure(src: SourceModel, cal, ids: np.ndarray, state: Path, pool: GPTQPool, progress: bool,
             damp: float, search: str) -> dict:  # fmt: skip
    prog_file = state / "measure_progress.json"
    done = json.loads(prog_file.read_text())["layers"] if prog_file.is_file() else 0
    meas: dict = {}
    for i in range(done):
        meas.update(json.loads((state / f"measure_{i:04d}.json").read_text()))
    if done:
        cal.set_states(np.load(state / "measure_states.npy"))
    else:
        cal.embed(ids)
    steps = [measure_steps(src.groups(i)) for i in range(src.n_layers)]
    with bar(total=sum(steps), desc="measurement", unit="step", enable=progress,
             initial=sum(steps[:done])) as pb:  # fmt: skip
        for i in range(done, src.n_layers):
            _hook("measure", i, "start")
            with timer("measure"):
                entries = measure_layer(src, cal, i, pool, tick=lambda: pb.update(1), damp=damp, search=search)
            for key, rows in entries.items():
                best = max(r["accuracy"] for r in rows)
                if best < 0.1:
                    raise InvalidArgumentError(f"measurement: {key} reaches accuracy {best:.3f} at best; "
                                               "the calibration forward is broken for this model")  # fmt: skip
            with timer("measure_io"):
                _atomic_json(state / f"measure_{i:04d}.json", entries)
                _atomic_npy(state / "measure_states.npy", cal.states())
                _atomic_json(prog_file, {"layers": i + 1})
            meas.update(entries)
    return meas


def _block_scales(src: SourceModel, cal, ids: np.ndarray, length: int, state: Path, progress: bool,
                  k: float) -> dict:  # fmt: skip
    """Per-group error weights for the allocation (measure.block_scales over the measurement rows with outlier
    threshold k; {} when k is 0), saved in the state folder for --resume."""
    if k == 0:
        return {}
    path = state / "block_scales.json"
    if path.is_file():
        return json.loads(path.read_text())
    cal = cal or src.calibration(len(ids), length)
    with bar(total=src.n_layers, desc="outlier scales", unit="layer", enable=progress) as pb, timer("scales"):
        cal.embed(ids)
        scales = block_scales(src, cal, k, tick=lambda: pb.update(1))
    _atomic_json(path, scales)
    return scales


def _kl_scales(src: SourceModel, cal, ids: np.ndarray, length: int, meas: dict, state: Path, out: Path,
               measurement, pool: GPTQPool, progress: bool, damp: float, search: str) -> dict:  # fmt: skip
    """measure.kl_scales of measure.kl_sensitivity over the measurement rows: from state (--resume), else from the
    kl_sensitivity.json beside `measurement` when made from the same rows and GPTQ settings, else measured;
    written to out/kl_sensitivity.json and the state folder."""
    import hashlib

    digest = hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int64).tobytes()).hexdigest()
    # what the sensitivities depend on: a file made from other rows or other GPTQ settings is measured again
    key = {"ids_sha256": digest, "ref_bpw": KL_REF_BPW, "gptq_damp": damp, "gptq_scale_search": search}
    path = state / "kl_sensitivity.json"
    cands = [path] + ([Path(measurement).parent / "kl_sensitivity.json"] if measurement else [])
    sens = None
    for c in cands:
        if c.is_file():
            d = json.loads(c.read_text())
            if all(d.get(k) == v for k, v in key.items()):
                sens = d["sensitivity"]
                break
    if sens is None:
        cal = cal or src.calibration(len(ids), length)
        with bar(total=src.n_layers, desc="KL sensitivity", unit="layer", enable=progress) as pb, timer("kl"):
            sens = kl_sensitivity(src, cal, ids, meas, pool, tick=lambda: pb.update(1), damp=damp, search=search)
    doc = {**key, "sensitivity": sens}
    _atomic_json(path, doc)
    _atomic_json(out / "kl_sensitivity.json", doc)
    return kl_scales(sens)


def _blocks(src: SourceModel,
            options: Callable[[str, list[dict]], list[tuple[dict, float]]]) -> tuple[list, dict, int]:  # fmt: skip
    """(the allocation's blocks, each block's shapes, the decoder linears' weights) with each block's options from
    options(key, group) -> [({role: QParams}, err)]."""
    shapes = src.shapes()
    blocks, block_shapes = [], {}
    numel = 0
    for i in range(src.n_layers):
        for key, group in src.groups(i).items():
            sh = shapes[key]
            block_shapes[key] = sh
            numel += sum(a * b * n for a, b, _, n in sh.values())
            opts = []
            for qps, err in options(key, group):
                groups = {r: qps[r].groups(sh[r][0]) for r in sh}
                cost = sum(alloc.linear_cost(groups[r], sh[r]) for r in sh)
                opts.append({"cost": cost, "err": err, "groups": groups})
            blocks.append({"key": key, "options": opts})
    return blocks, block_shapes, numel


def _check_bits_reachable(src: SourceModel, bits: float) -> None:
    """Before any calibration: bits within the averages the measurement's candidate rows (qparams.block_options) can
    reach on src (the allocation's own check, minutes earlier)."""
    from .qparams import block_options
    from .source import group_kind

    def rows(key, group):
        projs, options = block_options(group_kind(d["role"] for d in group))
        return [({r: row[projs.index(r)] for r in projs}, 0.0) for row in options]

    blocks, _, numel = _blocks(src, rows)
    lo = sum(min(o["cost"] for o in b["options"]) for b in blocks) / numel
    hi = sum(max(o["cost"] for o in b["options"]) for b in blocks) / numel
    if bits < lo - 1e-9:
        raise InvalidArgumentError(f"--bits {bits} is below the smallest average this model's candidates reach "
                                   f"({lo:.3f})")  # fmt: skip
    if bits > hi + 1e-9:
        raise InvalidArgumentError(f"--bits {bits} is above the largest average this model's candidates reach "
                                   f"({hi:.3f})")  # fmt: skip


def _allocate(src: SourceModel, meas: dict, bits: float, error_norm: float, scales: dict | None = None) -> dict:
    """One option per measurement group minimizing sum((scale * (1 - accuracy)) ** error_norm) (scales:
    _block_scales)."""
    scales = scales or {}

    def measured(key, group):
        return [({r: QParams.from_json(e[r]) for r in e if r in {d["role"] for d in group}},
                 (1.0 - float(e["accuracy"])) * scales.get(key, 1.0)) for e in meas[key]]  # fmt: skip

    blocks, block_shapes, numel = _blocks(src, measured)
    picks, summary = alloc.allocate(blocks, bits, numel, error_norm)
    configs = {b["key"]: b["options"][j]["groups"] for b, j in zip(blocks, picks)}
    errs = {b["key"]: b["options"][j]["err"] for b, j in zip(blocks, picks)}
    configs, used = alloc.fill(configs, block_shapes, errs, bits * numel)
    return {"picks": {b["key"]: j for b, j in zip(blocks, picks)}, "configs": configs, "bpw": used / numel,
            "numel": numel, "scales": scales, **summary}  # fmt: skip


def _quantize(src: SourceModel, ids: np.ndarray, length: int, strategy: dict, head_qp: QParams, state: Path,
              pool: GPTQPool, progress: bool, damp: float, search: str) -> dict:  # fmt: skip
    prog_file = state / "quant_progress.json"
    done = json.loads(prog_file.read_text())["layers"] if prog_file.is_file() else 0
    cal = src.calibration(len(ids), length)
    if done:
        cal.set_states(np.load(state / "quant_states.npy"))
    else:
        cal.embed(ids)
    per_layer = [len(src.layer_linears[i]) for i in range(src.n_layers)]
    with bar(total=sum(per_layer) + 1, desc="quantization", unit="linear", enable=progress,
             initial=sum(per_layer[:done])) as pb:  # fmt: skip
        for i in range(done, src.n_layers):
            configs = {key: strategy["configs"][key] for key in src.groups(i)}
            with timer("quant"):
                tens = quantize_layer(src, cal, i, configs, pool, hook=lambda where, i=i: _hook("quant", i, where),
                                      tick=lambda: pb.update(1), damp=damp, search=search)  # fmt: skip
            with timer("quant_io"):
                _save_tensors(state / f"quant_{i:04d}.safetensors", tens)
                _atomic_npy(state / "quant_states.npy", cal.states())
                _atomic_json(prog_file, {"layers": i + 1})
        head_file = state / "quant_head.safetensors"
        if not head_file.is_file():
            with timer("head"):
                _save_tensors(head_file, quantize_head(src, cal, head_qp, pool, damp, search))
        pb.update(1)
    del cal
    # the source's other tensors (embedding, norms) in fp16, then the quantized linears, in model order
    quantized = {d["name"] for i in range(src.n_layers) for d in src.layer_linears[i]} | {src.head_name}
    tensors: dict[str, np.ndarray] = {}
    for name in sorted(src.names, key=_model_order):
        prefix = name.rsplit(".", 1)[0]
        if prefix in quantized or name.endswith(".rotary_emb.inv_freq"):
            continue
        tensors[name] = src.raw(name)
    for i in range(src.n_layers):
        tensors.update(_load_tensors(state / f"quant_{i:04d}.safetensors"))
    tensors.update(_load_tensors(state / "quant_head.safetensors"))
    return tensors


def _model_order(name: str):
    """Sort key: layer tensors by layer number, the others by name."""
    parts = name.split(".")
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts]
