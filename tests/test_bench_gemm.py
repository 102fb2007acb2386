"""``tools/bench_gemm.py`` derives the frame's matmul shapes from the released 1.7B config: check them against the
architecture (fused QKV and gate/up projections, GQA) and the floor arithmetic; its dry run works without a GPU."""

import os
import subprocess
import sys
from pathlib import Path

from tools.bench_gemm import floor_us, frame_matmuls


def test_frame_matmul_shapes_of_the_1_7b_config() -> None:
    rows = {r["name"]: r for r in frame_matmuls("1.7b")}
    assert (rows["talker.qkv"]["n"], rows["talker.qkv"]["k"]) == ((16 + 2 * 8) * 128, 2048)
    assert (rows["talker.gate_up"]["n"], rows["talker.down"]["k"]) == (2 * 6144, 6144)
    assert rows["talker.qkv"]["calls"] == 28 and rows["cp.qkv"]["calls"] == 5 * 15
    assert (rows["cp.gate_up"]["n"], rows["cp.gate_up"]["k"]) == (2 * 3072, 1024)
    assert rows["cp.lm_head"]["calls"] == 15 and rows["cp.in_projection"]["k"] == 2048
    # 2048 x 2048 bf16 weights + a 64-row input and output: 8.9 MB at 4.26 TB/s
    assert abs(floor_us(64, 2048, 2048) - (2048 * 2048 + 2 * 64 * 2048) * 2 / 4.26e12 * 1e6) < 1e-9


def test_dry_run_prints_every_shape_and_a_per_frame_floor() -> None:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "tools" / "bench_gemm.py"), "--dry-run", "--m", "64"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == len(frame_matmuls("1.7b")) + 1 and '"per_frame_floor_ms"' in lines[-1]
