"""The package never imports torch: load a model and generate in a fresh interpreter, then check sys.modules."""

from __future__ import annotations

import subprocess
import sys


def test_load_and_generate_without_torch(tmp_path, smollm2_dir):
    code = (
        "import exl2cpp, sys\n"
        f"m = exl2cpp.load({str(smollm2_dir)!r}, max_seq_len=256)\n"
        "out = m.generate('Hello', max_new_tokens=4, temperature=0)\n"
        "assert isinstance(out, str)\n"
        "assert 'torch' not in sys.modules, sorted(k for k in sys.modules if 'torch' in k)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("ok")
