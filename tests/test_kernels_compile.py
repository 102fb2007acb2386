"""Every Triton kernel of the CUDA path compiles for the H200 (sm_90a) through its own wrapper, at the shapes
of Qwen3-TTS-1.7B, with no register spills (``kernels_compile_check.py``; a subprocess, because it replaces
Triton's launcher). No GPU needed: Triton's compiler and its bundled ptxas run on the CPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_every_kernel_compiles_for_sm90_without_spills() -> None:
    root = Path(__file__).resolve().parents[1]
    # fp fusion as the GPU image's Triton applies it by default (newer Triton warns until it is set)
    env = {**os.environ, "PYTHONPATH": str(root), "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(root / "tests" / "kernels_compile_check.py")], env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "kernels compile" in proc.stdout
    compiled = {line.split("'kernel': '")[1].split("'")[0] for line in proc.stdout.splitlines() if "'kernel'" in line}
    assert {"_norm_rope_kernel", "_decode_attention_kernel", "_sample_kernel",
            "_add_rms_norm_kernel", "_silu_mul_kernel", "_uniform_kernel", "_snake_kernel",
            "_packed_attention_kernel", "_rope_kernel"} <= compiled
