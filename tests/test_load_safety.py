"""Loading hostile or inconsistent model folders and engine options: every size computed from a file or a request is
checked before anything is allocated, every failure is the right exl2cpp.errors class naming the file or field, and a
loaded CPU model no longer depends on its files.

Cases that crashed the process before (a heap overflow, SIGBUS) run in a child process, so a crash fails the test
instead of killing pytest. scripts/asan_check.sh runs this file against an AddressSanitizer + UBSan build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import exl2cpp
import numpy as np
import pytest
from exl2cpp import _C
from exl2cpp.errors import (
    InvalidArgumentError,
    ModelFileError,
    ModelFormatError,
    OutOfMemoryError,
    UnsupportedError,
)
from safetensors.numpy import load_file, save_file

# Not resolved: under scripts/asan_check.sh the package is a copy next to the sanitized module.
PKG_PARENT = str(Path(exl2cpp.__file__).parent.parent)
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def make_tiny(
    folder: Path,
    n_layers: int = 2,
    config: dict | None = None,
    extra: dict | None = None,
    seed: int = 0,
    heads: int = 4,
    head_dim: int = 16,
) -> Path:
    """A random-weight f16 Llama folder (hidden 64, 2 KV heads, vocab 128): config.json + model.safetensors holding
    n_layers layers; `config` overrides config.json keys, `extra` adds tensors."""
    H, inter, V, kv = 64, 96, 128, 2
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": inter,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "vocab_size": V,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    cfg.update(config or {})
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float16)

    nq, nkv = heads * head_dim, kv * head_dim
    t = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": np.ones(H, np.float16)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(H, np.float16)
        t[p + "post_attention_layernorm.weight"] = np.ones(H, np.float16)
        t[p + "self_attn.q_proj.weight"] = w(nq, H)
        t[p + "self_attn.k_proj.weight"] = w(nkv, H)
        t[p + "self_attn.v_proj.weight"] = w(nkv, H)
        t[p + "self_attn.o_proj.weight"] = w(H, nq)
        t[p + "mlp.gate_proj.weight"] = w(inter, H)
        t[p + "mlp.up_proj.weight"] = w(inter, H)
        t[p + "mlp.down_proj.weight"] = w(H, inter)
    t.update(extra or {})
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def set_config(folder: Path, **keys) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(keys)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def run_child(code: str, *args: str, limit_gib: float | None = None, timeout: int = 120):
    """Run `code` in a fresh interpreter (argv[1:] = args); returns the CompletedProcess. limit_gib caps its address
    space (RLIMIT_AS) so that an unbounded allocation fails there instead of taking the machine's memory."""
    pre = ""
    if (
        limit_gib is not None and "LD_PRELOAD" not in os.environ
    ):  # ASan reserves terabytes of address space
        pre = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({int(limit_gib * 2**30)},) * 2)\n"
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", pre + textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


CHILD_LOAD = """
import sys, exl2cpp
from exl2cpp.errors import Exl2Error
try:
    kw = eval(sys.argv[2])
    exl2cpp.load(sys.argv[1], **kw)
    print("LOADED")
except Exl2Error as e:
    print("ERR", type(e).__name__, e)
"""


def child_load(folder: Path, **kw):
    r = run_child(CHILD_LOAD, str(folder), repr(kw), limit_gib=8)
    assert r.returncode == 0, f"child died with {r.returncode}: {r.stderr[-3000:]}"
    return r.stdout.strip()


@pytest.fixture
def tiny(tmp_path):
    return make_tiny(tmp_path / "tiny")


# ---- 1. sizes from files and requests ---------------------------------------------------------------------------


@pytest.mark.parametrize("seq", [2**31, 2**56, 2**58, 2**62, INT64_MAX])
def test_huge_max_seq_len_is_refused_before_the_rope_table(tiny, seq):
    out = child_load(tiny, max_seq_len=seq)
    assert out.startswith("ERR InvalidArgumentError"), out
    assert f"max_seq_len {seq} is larger than {INT32_MAX}" in out


@pytest.mark.parametrize("seq", [2**56, 2**58])
def test_huge_max_position_embeddings_is_refused(tiny, seq):
    set_config(tiny, max_position_embeddings=seq)
    out = child_load(tiny)
    assert out.startswith("ERR InvalidArgumentError"), out
    assert f"max_position_embeddings {seq}" in out and "config.json" in out and "max_seq_len" in out
    assert child_load(tiny, max_seq_len=64) == "LOADED"  # an explicit max_seq_len overrides it


def test_max_seq_len_beyond_int64_is_an_invalid_argument(tiny):
    with pytest.raises(InvalidArgumentError, match="max_seq_len"):
        exl2cpp.load(tiny, max_seq_len=2**70)


def test_rope_table_larger_than_memory_is_out_of_memory(tmp_path):
    """INT32_MAX positions x head_dim 256 x 4 bytes = 2 TiB of cos/sin table: refused with the numbers."""
    folder = make_tiny(tmp_path / "wide", heads=2, head_dim=256)
    out = child_load(folder, max_seq_len=INT32_MAX)
    assert out.startswith("ERR OutOfMemoryError"), out
    assert "max_seq_len" in out and str(INT32_MAX * 256 * 4) in out


def test_zero_sized_tensor_with_huge_dims_reads(tmp_path):
    """numel of [2^62, 4, 0] is 0; multiplying left to right would overflow int64 first (UBSan catches that)."""
    header = {
        "z": {"dtype": "F16", "shape": [2**62, 4, 0], "data_offsets": [0, 0]},
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
    }
    raw = json.dumps(header).encode()
    p = tmp_path / "z.safetensors"
    p.write_bytes(len(raw).to_bytes(8, "little") + raw + np.float32(1.5).tobytes())
    names = _C.safetensors_names(str(p))
    assert sorted(names) == ["a", "z"]


def test_config_dimensions_are_bounded(tiny):
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "head_dim",
        "vocab_size",
    ):
        cfg = json.loads((tiny / "config.json").read_text())
        set_config(tiny, **{key: 2**40})
        with pytest.raises(ModelFormatError, match=rf"'{key}' must be .*at most {INT32_MAX}"):
            _C.load_config(str(tiny))
        (tiny / "config.json").write_text(json.dumps(cfg))


# ---- 2. the KV cache and the engine's options ------------------------------------------------------------------

CHILD_ENGINE = """
import sys, exl2cpp
from exl2cpp.errors import Exl2Error
m = exl2cpp.load(sys.argv[1], max_seq_len=64)
try:
    exl2cpp.Engine(m, **eval(sys.argv[2]))
    print("MADE")
except Exl2Error as e:
    print("ERR", type(e).__name__, e)
# VmHWM: this process's peak (ru_maxrss would include the parent's, inherited through fork and exec)
print("MAXRSS_KB", [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0])
"""


@pytest.mark.parametrize("tokens", [2**40, 10**15, INT64_MAX])
def test_cache_larger_than_memory_is_refused_before_allocating(tiny, tokens):
    r = run_child(CHILD_ENGINE, str(tiny), repr({"cache_tokens": tokens}), limit_gib=4)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "ERR OutOfMemoryError" in out, out
    assert f"cache_tokens={tokens}" in out and "bytes" in out and "host memory" in out
    rss_mib = int(out.split("MAXRSS_KB")[1]) / 1024
    assert rss_mib < 1024, f"peak RSS {rss_mib:.0f} MiB: the cache was allocated before the check"


def test_engine_option_bounds(tiny):
    m = exl2cpp.load(tiny, max_seq_len=64)
    with pytest.raises(InvalidArgumentError, match=f"max_batch_tokens must be in .*{INT32_MAX}"):
        exl2cpp.Engine(m, cache_tokens=256, max_batch_tokens=2**40)
    with pytest.raises(InvalidArgumentError, match="cache_tokens"):
        exl2cpp.Engine(m, cache_tokens=2**70)
    e = exl2cpp.Engine(m, cache_tokens=300, max_batch_tokens=64)  # still fine
    assert e.stats()["pages_total"] == 2
    e.close()


def test_model_cache_for_huge_token_count(tiny):
    m = exl2cpp.load(tiny, max_seq_len=64)
    with pytest.raises(OutOfMemoryError, match="bytes"):
        m._core.make_cache(2**50, 256, "auto")
    with pytest.raises(OutOfMemoryError):
        m._core.make_cache(INT64_MAX, 256, "auto")


# ---- 3. loader errors ----------------------------------------------------------------------------------------------


def test_symlink_loop_in_the_folder_is_a_model_file_error(tiny):
    (tiny / "loop.safetensors").symlink_to("loop.safetensors")
    with pytest.raises(ModelFileError, match="loop.safetensors"):
        exl2cpp.load(tiny)


def test_symlink_loop_as_config_is_a_model_file_error(tiny):
    (tiny / "config.json").unlink()
    (tiny / "config.json").symlink_to("config.json")
    with pytest.raises(ModelFileError, match="config.json"):
        exl2cpp.load(tiny)


@pytest.mark.parametrize("n", [INT64_MAX, 2**40, INT32_MAX])
def test_huge_num_hidden_layers_is_a_model_format_error(tiny, n):
    set_config(tiny, num_hidden_layers=n)
    out = child_load(tiny)
    assert out.startswith("ERR ModelFormatError"), out
    assert "num_hidden_layers" in out


def test_more_layers_than_the_checkpoint(tiny):
    set_config(tiny, num_hidden_layers=3)
    with pytest.raises(
        ModelFormatError, match=r"num_hidden_layers is 3 but .*model.safetensors.* 2 layers"
    ):
        exl2cpp.load(tiny)
    with pytest.raises(ModelFormatError, match="num_hidden_layers is 3"):
        _C.weight_load_bytes(str(tiny), 64)


def test_fewer_layers_than_the_checkpoint_is_not_silent(tiny):
    set_config(tiny, num_hidden_layers=1)
    with pytest.raises(
        ModelFormatError, match=r"num_hidden_layers is 1 but .* 2 layers.*model\.layers\.1\."
    ):
        exl2cpp.load(tiny)


def test_unread_tensors_are_named(tmp_path):
    folder = make_tiny(
        tmp_path / "extra",
        extra={
            "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float16),
            "model.vision_tower.weight": np.zeros(4, np.float16),
        },
    )
    with pytest.raises(
        UnsupportedError, match=r"2 checkpoint tensor\(s\) are read by no module.*model\.layers\.0\.self_attn\.q_proj\.bias"
    ):
        exl2cpp.load(folder)


def test_rotary_inv_freq_buffers_are_ignored(tmp_path):
    """Older HF checkpoints store each layer's recomputable RoPE buffer; it carries no weights."""
    extra = {
        f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32) for i in range(2)
    }
    exl2cpp.load(make_tiny(tmp_path / "inv", extra=extra))


@pytest.mark.parametrize(
    "patch, key",
    [
        ({"rope_theta": 1e-308}, "rope_theta"),
        ({"rope_theta": 1.0}, "rope_theta"),
        ({"rope_theta": 0.5}, "rope_theta"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e-300}},
            "rope_parameters.rope_theta",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": -32}},
            "rope_scaling.beta_fast",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_slow": -1}},
            "rope_scaling.beta_slow",
        ),
        # get_mscale(factor, mscale_all_dim) = 0.1 * -1 * ln(e^10) + 1 = 0: the attention factor divides by zero
        (
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 22026.465794806718,
                    "mscale": 1,
                    "mscale_all_dim": -1,
                }
            },
            "rope_scaling.mscale_all_dim",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1e300}},
            "rope_scaling.attention_factor",
        ),
        # inv_freq / 1e-320 overflows: caught on the frequencies themselves
        ({"rope_scaling": {"rope_type": "linear", "factor": 1e-320}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 1e999}}, "Infinity"),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            "rope_scaling.low_freq_factor",
        ),
    ],
)
def test_bad_rope_parameters_are_refused(tiny, patch, key):
    set_config(tiny, **patch)
    with pytest.raises(ModelFormatError, match=key if key == "Infinity" else f"'{key}'"):
        exl2cpp.load(tiny)


def test_valid_rope_configs_give_finite_logits(tiny):
    for patch in (
        {"rope_theta": 1.5},
        {"rope_theta": 1e300},
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    ):
        set_config(tiny, **patch)
        logits = exl2cpp.load(tiny, max_seq_len=256).forward(list(range(1, 40)))
        assert np.isfinite(logits).all(), patch


# ---- 4. a loaded CPU model does not read its files -------------------------------------------------------------

CHILD_FILE_CHANGE = """
import os, sys, numpy as np, exl2cpp
folder, action, other = sys.argv[1], sys.argv[2], sys.argv[3]
m = exl2cpp.load(folder, max_seq_len=64)
ids = list(range(1, 30))
before = m.forward(ids)
f = os.path.join(folder, "model.safetensors")
if action == "truncate":
    os.truncate(f, 0)
elif action == "overwrite":  # in place, same inode: what `cp other f` does
    with open(other, "rb") as src, open(f, "r+b") as dst:
        dst.write(src.read())
after = m.forward(ids)
print("SAME" if np.array_equal(before, after) else "CHANGED")
"""


@pytest.mark.parametrize("action", ["truncate", "overwrite"])
def test_cpu_model_survives_its_file_changing(tmp_path, action):
    folder = make_tiny(tmp_path / "m", seed=1)
    other = make_tiny(tmp_path / "other", seed=2) / "model.safetensors"
    r = run_child(CHILD_FILE_CHANGE, str(folder), action, str(other))
    assert r.returncode == 0, f"child died with {r.returncode} (-7 = SIGBUS): {r.stderr[-2000:]}"
    assert r.stdout.strip() == "SAME"


def test_cpu_load_keeps_no_file_mapping(tiny):
    m = exl2cpp.load(tiny, max_seq_len=64)
    maps = Path("/proc/self/maps").read_text()
    assert str(tiny / "model.safetensors") not in maps
    del m


def test_cpu_weights_equal_the_file(tiny):
    """The copies are the file's bytes: logits match a load from a second copy of the folder."""
    t = load_file(str(tiny / "model.safetensors"))
    assert t["model.embed_tokens.weight"].dtype == np.float16
    a = exl2cpp.load(tiny, max_seq_len=64).forward([5, 6, 7])
    b = exl2cpp.load(tiny, max_seq_len=64).forward([5, 6, 7])
    assert np.array_equal(a, b) and np.isfinite(a).all()


# ---- the server's /admin/load ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_admin_load_with_huge_sizes_answers_400_and_the_server_lives(smollm2_dir):
    """max_seq_len 2^58 (a RoPE table whose byte count wrapped to 0: a heap overflow that killed the server) and
    cache_tokens 10^15 / 2^40 (a MemoryError, a 500): each a 400 naming the value; the server keeps answering."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from test_server import ADMIN, KEY, ServerProc

    srv = ServerProc(
        smollm2_dir,
        "--api-key",
        KEY,
        "--admin-key",
        ADMIN,
        "--cache-tokens",
        "2048",
        "--model-name",
        "smollm2",
        env={"PYTHONPATH": PKG_PARENT},
    )
    admin = {"Authorization": f"Bearer {ADMIN}"}
    try:
        for body, words in [
            ({"max_seq_len": 2**58}, "max_seq_len=288230376151711744 is out of range: at most 2147483647"),
            ({"cache_tokens": 10**15}, "cache_tokens=1000000000000000"),
            ({"cache_tokens": 2**40}, "cache_tokens=1099511627776"),
        ]:
            r = httpx.post(
                srv.url + "/admin/load",
                headers=admin,
                timeout=120,
                json={"model": str(smollm2_dir), **body},
            )
            assert r.status_code == 400, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert words in err["message"] and err["param"] == next(iter(body)), err
            assert srv.proc.poll() is None, srv.logs()[-3000:]
            assert httpx.get(srv.url + "/health", timeout=10).status_code in (200, 503)
        r = httpx.post(
            srv.url + "/admin/load",
            headers=admin,
            timeout=120,
            json={"model": str(smollm2_dir), "model_name": "smollm2", "cache_tokens": 2048},
        )
        assert r.status_code == 200, r.text
        r = httpx.post(
            srv.url + "/v1/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
            json={"model": "smollm2", "prompt": "One, two,", "max_tokens": 3, "temperature": 0},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    finally:
        srv.stop()
