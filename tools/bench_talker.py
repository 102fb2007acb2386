"""Talker-stage step times on real-size Qwen3-TTS-1.7B shapes (random weights, bf16, CUDA).

Per batch size: the decode frame step (talker decode + codec head + sampling + 15-step code predictor
+ next input) eager vs CUDA graph; talker decode alone and code predictor alone (graph); the runner end
to end (plans through ``CudaTalkerRunner.submit`` with 2 in flight, decode-only steady state); and the
bandwidth floor (weights + KV bytes read per step at 4.26 TB/s, PERF-NOTES' measured copy rate).

    python tools/bench_talker.py --batch 1 8 64 --context 256 [--out benchmarks/talker-steps.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass

import torch

from omniloop.gpu.backends import configure_cuda_stage
from omniloop.gpu.cuda_graphs import FrameGraphs, batch_buckets
from omniloop.gpu.kv_budget import module_bytes
from omniloop.gpu.talker_runner import TalkerRunner
from omniloop.gpu.talker_state import TalkerState
from omniloop.models.qwen3_tts import layers
from omniloop.models.qwen3_tts.config import load_tts_config
from omniloop.models.qwen3_tts.tiny import ensure_tiny_checkpoint
from omniloop.models.qwen3_tts.prompt import Prompt, TtsInput
from omniloop.models.qwen3_tts.talker import Qwen3TtsModel
from omniloop.scheduler.plan import ArNew, ArSeq, ArStepPlan

COPY_BYTES_PER_S = 4.26e12


@dataclass
class _Payload:
    inputs: TtsInput
    prompt: Prompt | None
SAMPLED = dict(do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05,
               sub_do_sample=True, sub_temperature=0.9, sub_top_k=50, sub_top_p=1.0)


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def count_gpu_ops(fn) -> int:
    """Kernels, copies and memsets one call launches (what a graph of it replays), from torch.profiler."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def kernel_table(fn, top: int = 45) -> list[tuple[str, int, float]]:
    """(kernel name, launches, total us) of one call, most launches first: where the op count comes from."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    table: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = table.setdefault(e.name[:90], [0, 0.0])
            row[0] += 1
            row[1] += e.device_time_total
    return sorted(((k, int(n), round(us, 1)) for k, (n, us) in table.items()), key=lambda r: -r[1])[:top]


def graph_of(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def random_model(device: torch.device | str = "cuda") -> Qwen3TtsModel:
    """The released 1.7B talker-stage shapes with random weights in bf16 (timing only)."""
    cfg = load_tts_config(ensure_tiny_checkpoint("base", size="1.7b"))
    model = Qwen3TtsModel(cfg, device=device, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return model


def sampled_state(model: Qwen3TtsModel, rows: int, context: int) -> TalkerState:
    """A decode state of ``rows`` sampled requests (slot i seeded i) with room for ``context`` keys, trailing
    text on the state's device as the runner's prompts are, and a random next input; the model's projections
    fused first, as the CUDA runner does."""
    model.fuse_projections()
    state = TalkerState.allocate(model, rows, context + 8, max_trailing=64)
    hidden = model.cfg.talker.decoder.hidden_size
    for slot in range(rows):
        state.reset(slot, torch.zeros(1, 1), torch.zeros(4, hidden, device=model.device), SAMPLED, slot)
    state.next_input.normal_()
    return state


@torch.no_grad()
def bench_pieces(model: Qwen3TtsModel, batch: list[int], context: int, iters: int,
                 kernels: bool = False) -> list[dict]:
    state = sampled_state(model, max(batch), context)
    dec, cp = model.talker.model, model.code_predictor
    talker_bytes = module_bytes(dec) + module_bytes(model.talker.codec_head)
    cp_bytes = module_bytes(cp.model) + sum(module_bytes(h) for h in cp.lm_head) + module_bytes(cp.small_to_mtp_projection)
    kv_per_token = model.cfg.talker.decoder.num_layers * 2 * 8 * 128 * 2
    rows = []
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graphs = FrameGraphs(state, stream, tuple(batch), (context,))
        for b in batch:
            state.active[:b] = True
            state.positions[:b] = context - 1  # every row reads the whole bucket: context keys
            frame_graph = lambda b=b: graphs.replay(b, context)  # noqa: E731
            eager = lambda b=b: state.decode_frame(b, context)  # noqa: E731
            x = state.next_input[:b, None]
            pos = state.positions[:b, None]
            talker_only = graph_of(lambda: dec(x, pos, state.cache.k, state.cache.v, None, context))
            hidden = torch.randn(b, 2048, device="cuda", dtype=model.dtype)
            params = type(state.params)(**{k: v[:b] for k, v in vars(state.params).items()})
            code0 = torch.zeros(b, dtype=torch.int64, device="cuda")
            cp_only = graph_of(lambda: cp.predict(hidden, model.codec_embed(code0), params, state.step[:b]))
            floor_talker = (talker_bytes + b * context * kv_per_token) / COPY_BYTES_PER_S * 1e3
            floor_cp = 15 * cp_bytes / COPY_BYTES_PER_S * 1e3
            rows.append(dict(
                batch=b, context=context, gpu_ops_per_frame=count_gpu_ops(eager),
                frame_graph_ms=time_ms(frame_graph, iters), frame_eager_ms=time_ms(eager, max(3, iters // 10)),
                talker_graph_ms=time_ms(talker_only.replay, iters), cp_graph_ms=time_ms(cp_only.replay, iters),
                floor_talker_ms=floor_talker, floor_cp_ms=floor_cp))
            if kernels:
                rows[-1]["kernels_per_frame"] = kernel_table(eager)
            print(json.dumps(rows[-1]), flush=True)
    stream.synchronize()
    model.cache = None
    return rows


def _admit_plan(model: Qwen3TtsModel, step_id: int, b: int, prompt_len: int) -> ArStepPlan:
    """A plan that admits ``b`` sampled requests in slots 0..b-1, each with a random ``prompt_len``-token prompt,
    and prefills them whole (their first frame is sampled in the frame step)."""
    h = model.cfg.talker.decoder.hidden_size
    new, seqs = [], []
    for slot in range(b):
        prompt = Prompt(embeds=torch.randn(prompt_len, h, device="cuda", dtype=model.dtype),
                        trailing=torch.randn(4, h, device="cuda", dtype=model.dtype))
        inputs = TtsInput(task="base", input_ids=torch.zeros(9, dtype=torch.int64), sampling=SAMPLED, seed=slot)
        new.append(ArNew(f"r{slot}", slot, _Payload(inputs, prompt)))
        seqs.append(ArSeq(f"r{slot}", slot, 0, prompt_len, True, False))
    return ArStepPlan(step_id, seqs, new)


async def _runner_steps(model: Qwen3TtsModel, b: int, context: int, steps: int) -> float:
    """Seconds per decode plan, steady state, 2 plans in flight, through ``submit``."""
    max_len = context + steps + 16
    runner = TalkerRunner(model, device="cuda", max_num_seqs=b, max_len=max_len, use_cuda_graphs=True,
                          graph_buckets=((b,), (max_len,)))
    try:
        prompt_len = context - 1
        await runner.submit(_admit_plan(model, 0, b, prompt_len))
        pending: list[asyncio.Future] = []
        t0 = 0.0
        for k in range(steps):
            if k == 5:
                t0 = time.perf_counter()
            plan = ArStepPlan(k + 1, [ArSeq(f"r{s}", s, prompt_len + k, 1, True, True) for s in range(b)])
            pending.append(runner.submit(plan))
            if len(pending) == 2:
                await pending.pop(0)
        for f in pending:
            await f
        return (time.perf_counter() - t0) / (steps - 5)
    finally:
        runner.close()


@torch.no_grad()
def bench_compiled_cp(model: Qwen3TtsModel, batch: list[int]) -> list[dict]:
    """The code predictor loop through ``torch.compile`` (default mode), then captured: time vs the plain
    graph, and how many codes equal the plain version on the same inputs (greedy sub-sampling)."""
    from omniloop.models.qwen3_tts.generate import GREEDY
    from omniloop.models.qwen3_tts.sampling import SamplingParams

    cp = model.code_predictor
    compiled = torch.compile(cp.predict, dynamic=False)
    rows = []
    for b in batch:
        params = SamplingParams.stack([dict(GREEDY, seed=i) for i in range(b)], "cuda")
        hidden = torch.randn(b, 2048, device="cuda", dtype=model.dtype)
        emb = torch.randn(b, 2048, device="cuda", dtype=model.dtype)
        step = torch.zeros(b, dtype=torch.int64, device="cuda")
        t0 = time.perf_counter()
        compiled(hidden, emb, params, step)
        compile_s = time.perf_counter() - t0
        out = {}
        plain_graph = graph_of(lambda: out.__setitem__("plain", cp.predict(hidden, emb, params, step)))
        fused_graph = graph_of(lambda: out.__setitem__("fused", compiled(hidden, emb, params, step)))
        plain_graph.replay()
        fused_graph.replay()
        torch.cuda.synchronize()
        rows.append(dict(batch=b, compile_s=compile_s, cp_graph_ms=time_ms(plain_graph.replay, 50),
                         cp_compiled_graph_ms=time_ms(fused_graph.replay, 50),
                         codes_equal=(out["plain"] == out["fused"]).float().mean().item()))
        print(json.dumps(rows[-1]), flush=True)
    return rows


@torch.no_grad()
def bench_sampling(batch: list[int]) -> list[dict]:
    """What the 16 per-frame samplings cost alone (graph): code 0 over 3072 ids + 15 x 2048, and the
    counter-based uniforms alone, plain and through ``torch.compile`` (elementwise: fuses into one kernel)."""
    from omniloop.models.qwen3_tts.sampling import counter_uniform, sample

    fused_uniform = torch.compile(counter_uniform, dynamic=False)
    rows = []
    for b in batch:
        args = dict(do_sample=torch.ones(b, dtype=torch.bool, device="cuda"),
                    temperature=torch.full((b,), 0.9, device="cuda"),
                    top_k=torch.full((b,), 50, dtype=torch.int64, device="cuda"),
                    top_p=torch.ones(b, device="cuda"), seed=torch.arange(b, device="cuda"),
                    step=torch.zeros(b, dtype=torch.int64, device="cuda"))
        logits0, logits = torch.randn(b, 3072, device="cuda"), torch.randn(b, 2048, device="cuda")

        def frame() -> None:
            sample(logits0, group=0, **args)
            for g in range(1, 16):
                sample(logits, group=g, **args)

        def uniforms(fn=counter_uniform) -> None:
            fn(args["seed"], args["step"], 0, 3072)
            for g in range(1, 16):
                fn(args["seed"], args["step"], g, 2048)

        t0 = time.perf_counter()
        uniforms(fused_uniform)
        compile_s = time.perf_counter() - t0
        same = torch.equal(fused_uniform(args["seed"], args["step"], 3, 2048), counter_uniform(args["seed"], args["step"], 3, 2048))
        rows.append(dict(batch=b, sample16_graph_ms=time_ms(graph_of(frame).replay, 50),
                         uniform16_graph_ms=time_ms(graph_of(uniforms).replay, 50),
                         uniform16_compiled_graph_ms=time_ms(graph_of(lambda: uniforms(fused_uniform)).replay, 50),
                         compile_s=compile_s, compiled_uniform_bitwise_equal=same))
        print(json.dumps(rows[-1]), flush=True)
    return rows


@torch.no_grad()
def bench_prefill(model: Qwen3TtsModel, shapes: list[str], prefill_graphs: bool = True) -> list[dict]:
    """Prefill steps as the runner runs them (``TalkerSteps.run`` of a plan that admits B requests with
    L-token prompts and prefills them whole, the first frame sampled in the frame step): ms per plan, and
    torch.profiler's top CPU and CUDA ops of one plan."""
    from omniloop.gpu.talker_runner import TalkerSteps

    rows = []
    max_b = max(int(s.split("x")[0]) for s in shapes)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        steps = TalkerSteps(model, torch.device("cuda"), max_b, 4096, (tuple(batch_buckets(max_b)), (256, 4096)),
                            stream, prefill_graphs=prefill_graphs)
        for shape in shapes:
            b, n = (int(v) for v in shape.split("x"))

            def run(k: int = 0, b=b, n=n) -> None:
                steps.run(_admit_plan(model, k, b, n))
                stream.synchronize()

            for k in range(3):
                run(k)
            t0 = time.perf_counter()
            for k in range(5):
                run(k)
            ms = (time.perf_counter() - t0) / 5 * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                run()
            table = prof.key_averages()
            kernels = [e for e in table if not e.key.startswith("aten::") and e.self_device_time_total > 0]
            top_cuda = sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]
            top_cpu = sorted(table, key=lambda e: -e.self_cpu_time_total)[:12]
            row = dict(batch=b, tokens=n, plan_ms=ms,
                       cuda_total_ms=sum(e.self_device_time_total for e in table) / 1e3,
                       top_cuda=[(e.key[:70], e.count, round(e.self_device_time_total / 1e3, 2)) for e in top_cuda],
                       top_cpu=[(e.key[:60], e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in top_cpu])
            rows.append(row)
            print(json.dumps(row), flush=True)
    model.cache = None
    return rows


def set_variant(name: str) -> None:
    """The decode kernels of one ``--variants`` entry (every switch off first, the partial sums too, though the
    tree has them on: its default frame is ``attention+down:4+o:4``); parts joined by ``+`` combine, e.g.
    ``attention+stages:2`` or ``attention+down:4+o:2``."""
    from omniloop.gpu.kernels import decode_attention

    layers.FUSED_QKV_ATTENTION = False
    decode_attention.NUM_STAGES = None
    layers.DOWN_PARTS = layers.O_PARTS = 0
    for part in name.split("+"):
        kind, _, arg = part.partition(":")
        if kind not in ("off", "attention", "stages", "down", "o"):
            raise SystemExit(f"unknown variant {part!r} in {name!r}")
        if kind == "attention":
            layers.FUSED_QKV_ATTENTION = True
        if kind == "stages":
            decode_attention.NUM_STAGES = int(arg)
        if kind == "down":  # the down projection as P float32 partial sums the next norm adds up
            layers.DOWN_PARTS = int(arg)
        if kind == "o":  # the same for the attention's output projection
            layers.O_PARTS = int(arg)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--runner-steps", type=int, default=60)
    parser.add_argument("--compile", action="store_true", help="only the torch.compile experiment")
    parser.add_argument("--sampling", action="store_true", help="only the sampling cost breakdown")
    parser.add_argument("--no-fused-norm-rope", action="store_true", help="torch q/k norm + rope on CUDA")
    parser.add_argument("--no-fused-decode-attention", action="store_true",
                        help="SDPA for the talker decode and code predictor attention on CUDA")
    parser.add_argument("--prefill", nargs="*", help="only prefill plans of BxL, e.g. 1x120 36x120")
    parser.add_argument("--no-prefill-graphs", action="store_true", help="--prefill: the eager prefill")
    parser.add_argument("--kernels", action="store_true", help="also list the kernels of one frame by launches")
    parser.add_argument("--attention-stages", type=int,
                        help="software-pipeline depth of the decode attention's key loop (decode_attention.NUM_STAGES)")
    parser.add_argument("--padded-prefill", action="store_true",
                        help="--prefill: the (rows x tokens) graphs instead of packed prompts (prefill_graphs.PACKED)")
    parser.add_argument("--no-fused-qkv-attention", action="store_true",
                        help="q/k norm+rope and KV write apart from the decode attention (layers.FUSED_QKV_ATTENTION)")
    parser.add_argument("--variants", help="comma-separated frame variants timed in one process: off, attention "
                        "(q/k norm+rope and KV write in the decode attention), stages:N (its key-loop depth), "
                        "down:P / o:P (that projection as P partial sums the next norm adds); combined with +")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.no_fused_norm_rope:
        layers.FUSED_NORM_ROPE = False
    if args.no_fused_decode_attention:
        layers.FUSED_DECODE_ATTENTION = False
    if args.no_fused_qkv_attention:
        layers.FUSED_QKV_ATTENTION = False
    if args.attention_stages:
        from omniloop.gpu.kernels import decode_attention

        decode_attention.NUM_STAGES = args.attention_stages
    if args.padded_prefill:
        from omniloop.gpu import prefill_graphs

        prefill_graphs.PACKED = False
    torch.manual_seed(0)
    configure_cuda_stage()  # as every GPU stage of the engine runs (cuDNN attention off)
    model = random_model()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"fused norm+rope {layers.FUSED_NORM_ROPE}, fused decode attention {layers.FUSED_DECODE_ATTENTION}, "
          f"fused qkv attention {layers.FUSED_QKV_ATTENTION}, "
          f"talker-stage weights {module_bytes(model) / 1e9:.2f} GB", flush=True)
    if args.compile or args.sampling or args.prefill:
        if args.prefill:
            rows = bench_prefill(model, args.prefill, prefill_graphs=not args.no_prefill_graphs)
        else:
            rows = bench_compiled_cp(model, args.batch) if args.compile else bench_sampling(args.batch)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(rows, fh, indent=1)
        return
    rows = []
    for variant in (args.variants.split(",") if args.variants else [None]):
        if variant is not None:
            set_variant(variant)
        for row in bench_pieces(model, args.batch, args.context, args.iters, kernels=args.kernels):
            if variant is not None:
                row["variant"] = variant
            if args.runner_steps > 5:
                per_plan = asyncio.run(_runner_steps(model, row["batch"], args.context, args.runner_steps))
                row["runner_plan_ms"] = per_plan * 1e3
                row["runner_frames_per_s"] = row["batch"] / per_plan
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
