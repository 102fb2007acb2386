"""The frame step's matmuls one by one, at decode batch sizes, against their weight-read floor (CUDA, bf16).

The talker's frame at 64 rows spends ~3.1 of its 5.2 ms of kernel time in cuBLASLt GEMMs with M = 64, about twice
the time it takes to read their weights (benchmarks/talker-steps.md). This says which of them are far from the
floor: each projection of the talker (x per frame: its layers) and of the code predictor (x layers x 15 steps),
timed as ``reps`` back-to-back calls replayed from one CUDA graph (so in-graph launch gaps count, as in the frame),
with the bytes it must read (weights + activations) and the achieved fraction of the 4.26 TB/s copy rate.

    python tools/bench_gemm.py --m 64 [--reps 50] [--out gemm.json]      # on the GPU
    python tools/bench_gemm.py --dry-run                                  # the shapes and floors only (any machine)
    python tools/bench_gemm.py --m 64 --fused [--out fused.json]          # fused_linear tile sweep (GPU)

``--fused``: each projection as the frame runs it with ``layers.FUSED_LINEAR`` (qkv and gate/up with the RMSNorm
before them, gate/up with SiLU*up, o and down with the residual add) through ``gpu/kernels/fused_linear.py`` at
each tile of ``FUSED_TILES``, against the same work in torch (``F.rms_norm`` / ``F.linear`` / SiLU*up / add, the
kernels it replaces); prints the best tile per shape in ``fused_linear.TILES``'s form.
"""

from __future__ import annotations

import argparse
import json

import torch

from omniloop.models.qwen3_tts.config import load_tts_config
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint

COPY_BYTES_PER_S = 4.26e12
L2_BYTES = 50 * 2**20


def frame_matmuls(size: str = "1.7b") -> list[dict]:
    """(name, N, K, calls per frame) of every projection a decode frame runs, from the released config."""
    cfg = load_tts_config(ensure_tiny_checkpoint("custom_voice", size=size))
    rows = []
    for part, dec, per_layer_calls in (("talker", cfg.talker.decoder, 1),
                                       ("cp", cfg.talker.code_predictor, cfg.talker.num_code_groups - 1)):
        h, d = dec.hidden_size, dec.head_dim
        calls = dec.num_layers * per_layer_calls
        rows += [dict(name=f"{part}.qkv", n=(dec.num_heads + 2 * dec.num_kv_heads) * d, k=h, calls=calls),
                 dict(name=f"{part}.o", n=h, k=dec.num_heads * d, calls=calls),
                 dict(name=f"{part}.gate_up", n=2 * dec.intermediate_size, k=h, calls=calls),
                 dict(name=f"{part}.down", n=h, k=dec.intermediate_size, calls=calls)]
    talker_h, cp = cfg.talker.decoder.hidden_size, cfg.talker.code_predictor
    rows.append(dict(name="talker.codec_head", n=cfg.talker.decoder.vocab_size, k=talker_h, calls=1))
    rows.append(dict(name="cp.lm_head", n=cp.vocab_size, k=cp.hidden_size, calls=cfg.talker.num_code_groups - 1))
    if cp.hidden_size != talker_h:  # the first step's two rows; later steps gather the projected input table
        rows.append(dict(name="cp.in_projection", n=cp.hidden_size, k=talker_h, calls=1))
    return rows


def floor_us(m: int, n: int, k: int, elem: int = 2) -> float:
    return (n * k + m * k + m * n) * elem / COPY_BYTES_PER_S * 1e6


FUSED_TILES = ((16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 4), (16, 256, 3, 4), (32, 64, 4, 4), (64, 64, 4, 4),
               (128, 64, 3, 8))


def fused_mode(name: str) -> dict:
    """What ``_forward_fused_linear`` does around each projection (heads and the input projection: plain)."""
    kind = name.split(".", 1)[1]
    return dict(qkv=dict(norm=True), gate_up=dict(norm=True, silu=True), o=dict(residual=True),
                down=dict(residual=True)).get(kind, {})


def _torch_chain(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, norm: bool = False, silu: bool = False,
                 residual: bool = False) -> torch.Tensor:
    h = torch.nn.functional.rms_norm(x, (x.shape[-1],), g, 1e-6) if norm else x
    y = torch.nn.functional.linear(h, w)
    if silu:
        half = y.shape[-1] // 2
        y = torch.nn.functional.silu(y[:, :half]) * y[:, half:]
    return y + x[:, :y.shape[-1]] if residual else y


@torch.no_grad()
def time_us(m: int, n: int, k: int, reps: int, call=None) -> float:
    """µs per call of ``call(x, w, g)`` (default ``F.linear(x, w)``) over ``reps`` calls replayed from one graph."""
    call = call or (lambda x, w, g: torch.nn.functional.linear(x, w))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    # distinct weight copies, more bytes than the H200's 50 MB L2 together, used in turn: in the frame every
    # layer reads its own weights, so timing one weight over and over would read it from L2
    copies = min(reps, max(2, -(-L2_BYTES * 2 // (n * k * 2))))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in ws[:3]:
            call(x, w, g)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            call(x, ws[i % copies], g)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[64])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--size", default="1.7b")
    parser.add_argument("--dry-run", action="store_true", help="shapes and floors only")
    parser.add_argument("--fused", action="store_true", help="fused_linear tile sweep against the torch chain")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry-run)")
    if args.fused:
        results = sweep_fused(args.m, args.reps, args.size)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, reps=args.reps,
                               rows=results), f, indent=1)
        return
    results = []
    for m in args.m:
        total_us = total_floor = 0.0
        for row in frame_matmuls(args.size):
            fl = floor_us(m, row["n"], row["k"])
            r = dict(row, m=m, floor_us=round(fl, 2))
            if not args.dry_run:
                us = time_us(m, row["n"], row["k"], args.reps)
                r.update(us=round(us, 2), of_floor=round(fl / us, 3))
                total_us += us * row["calls"]
            total_floor += fl * row["calls"]
            results.append(r)
            print(json.dumps(r), flush=True)
        summary = dict(m=m, per_frame_floor_ms=round(total_floor / 1e3, 3))
        if not args.dry_run:
            summary["per_frame_ms"] = round(total_us / 1e3, 3)
        print(json.dumps(summary), flush=True)
        results.append(summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if not args.dry_run else None,
                           torch=torch.__version__, reps=args.reps, rows=results), f, indent=1)


def sweep_fused(ms: list[int], reps: int, size: str) -> list[dict]:
    from omniloop.gpu.kernels import fused_linear as fl

    results, best = [], {}
    for m in ms:
        for row in frame_matmuls(size):
            mode = fused_mode(row["name"])
            # a [gate; up] weight of 2N rows gives N outputs; a residual needs outputs of the input's width
            n, k = row["n"], row["k"]
            r = dict(row, m=m, mode=sorted(mode), torch_us=round(time_us(m, n, k, reps,
                                                                        lambda x, w, g: _chain(x, w, g, mode)), 2))
            for tile in FUSED_TILES:
                fl.TILE_OVERRIDE = tile
                try:
                    us = time_us(m, n, k, reps, lambda x, w, g: _fused(fl, x, w, g, mode))
                except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses (shared memory) is skipped
                    r[str(tile)] = f"failed: {type(exc).__name__}"
                    continue
                finally:
                    fl.TILE_OVERRIDE = None
                r[str(tile)] = round(us, 2)
            timed = {t: v for t, v in r.items() if t.startswith("(") and isinstance(v, float)}
            if timed:
                r["best"] = min(timed, key=timed.get)
                if timed[r["best"]] >= r["torch_us"]:
                    r["best"] = "torch"  # TILES[...] = None: fused_linear runs the separate kernels
                best[(n // 2 if mode.get("silu") else n, k, bool(mode.get("silu")))] = r["best"]
            results.append(r)
            print(json.dumps(r), flush=True)
    print("fused_linear.TILES =", {key: None if t == "torch" else tuple(int(v) for v in t.strip("()").split(","))
                                   for key, t in best.items()})
    return results


def _chain(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, mode: dict) -> torch.Tensor:
    if mode.get("residual"):
        return _torch_chain(x, w, g, residual=False) + _residual(x, w)
    return _torch_chain(x, w, g, **mode)


def _residual(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A residual of the output's shape, cached per (rows, N): the frame reads one, it is not timed to build."""
    key = (x.shape[0], w.shape[0], x.device)
    if key not in _RESIDUALS:
        _RESIDUALS[key] = torch.randn(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    return _RESIDUALS[key]


_RESIDUALS: dict = {}


def _fused(fl, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, mode: dict) -> torch.Tensor:  # noqa: ANN001
    return fl.fused_linear(x, w, norm=(g, 1e-6) if mode.get("norm") else None, silu=bool(mode.get("silu")),
                           residual=_residual(x, w) if mode.get("residual") else None)


if __name__ == "__main__":
    main()
