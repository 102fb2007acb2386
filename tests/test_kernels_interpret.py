"""The CUDA path's Triton kernels (sampler, q/k norm+rope, SiLU*up), run on CPU by Triton's interpreter, equal
the torch code they replace (``kernels_interpret_check.py``; a subprocess, because the interpreter is chosen
when the kernels are defined). The same comparisons run on the GPU in ``test_kernels_gpu.py``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_triton_kernels_equal_the_torch_path_under_the_interpreter() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(root / "tests" / "kernels_interpret_check.py")], env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "kernels ok" in proc.stdout
