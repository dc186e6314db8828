"""A wheel from scripts/build_wheels.sh installs without a build (pip --no-index --no-deps into a fresh --target)
and runs on the CPU backend, on a machine with no GPU too: the package imported is the installed one, its
build_info names a run-time-chosen ISA, and `exl2cpp run` answers with the default model.

Skipped (with the command that builds one) when dist/wheelhouse holds no wheel this interpreter can install.
The wheel's NVIDIA requirements (a CUDA wheel needs nvidia-cublas / nvidia-cuda-runtime to import) come from the
wheels build_wheels.sh downloaded into dist/deps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WHEELHOUSE = REPO / "dist" / "wheelhouse"
DEPS = REPO / "dist" / "deps"


def installable_wheel() -> Path | None:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    here = set(sys_tags())
    for whl in sorted(WHEELHOUSE.glob("exl2cpp-*.whl")):
        if set(parse_wheel_filename(whl.name)[3]) & here:
            return whl
    return None


def nvidia_requirements(whl: Path) -> list[str]:
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [l.split(":", 1)[1].strip() for l in lines if l.startswith("Requires-Dist: nvidia-")]


@pytest.mark.slow
def test_wheel_installs_and_runs_on_cpu(tmp_path, models_cache):
    whl = installable_wheel()
    if whl is None:
        pytest.skip(
            f"no exl2cpp wheel for this interpreter in {WHEELHOUSE}: build one with "
            f"PYTHONS={sys.version_info[0]}.{sys.version_info[1]} scripts/build_wheels.sh"
        )
    extra = []
    for req in nvidia_requirements(whl):
        name = req.split("<")[0].split(">")[0].split("=")[0].strip().replace("-", "_")
        found = sorted(DEPS.glob(f"{name}-*.whl"))
        if not found:
            pytest.skip(f"{whl.name} requires {req}: run scripts/build_wheels.sh once (it downloads it into {DEPS})")
        extra.append(str(found[-1]))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--target", str(target), str(whl), *extra],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), EXL2CPP_CACHE=str(models_cache), CUDA_VISIBLE_DEVICES="")
    probe = (
        "import json, exl2cpp; from exl2cpp import _C; "
        "print(json.dumps({'file': exl2cpp.__file__, 'info': _C.build_info()}))"
    )
    r = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).resolve().is_relative_to(target.resolve()), got["file"]
    info = got["info"]
    assert info["native"] is False  # a portable build: no -march=native
    assert info["cpu_isa"] == info["cpu_isa_best"] and info["cpu_isa"] in info["cpu_isas_supported"]
    assert info["cuda"] == bool(extra)  # a CUDA wheel declares the NVIDIA libraries it links
    r = subprocess.run(
        [str(target / "bin" / "exl2cpp"), "run", "--device", "cpu", "-n", "8", "What is the capital of France?"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.stdout.strip()) > 0, "no text generated"
