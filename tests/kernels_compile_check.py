"""Run by ``test_kernels_compile.py`` in a subprocess: every Triton kernel of the CUDA path, launched through
its own Python wrapper with the shapes and dtypes of Qwen3-TTS-1.7B (CPU tensors), is compiled for the H200
(sm_90a) instead of launched, and ptxas reports its registers and spills. No GPU needed: a kernel that no
longer compiles for the GPU, or that spills, fails here instead of on the device.

The launch is intercepted at ``JITFunction.run``: the signature is built from the arguments as Triton's
launcher builds it (tensors as typed pointers, 16-divisible integers and addresses marked so, ``None`` and
``tl.constexpr`` parameters as constants), then ``triton.compile`` runs for ``GPUTarget("cuda", 90, 32)``.
Prints one line per compiled variant and ``kernels compile`` at the end."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
           torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8"}
RESULTS: list[dict] = []


def _ptxas() -> Path:
    """Triton's bundled ptxas that reads the PTX version Triton writes."""
    bins = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (bins / name).exists():
            return bins / name
    raise FileNotFoundError(f"no ptxas under {bins}")


def _compile(fn: JITFunction, args: tuple, kwargs: dict) -> None:
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(fn.arg_names, args)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        value = values[name] if name in values else param.default
        if param.is_constexpr or value is None:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:  # Triton's launcher makes 1 a constant
                signature[name] = "constexpr"
                constexprs[(i,)] = 1
                continue
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=TARGET, options=options)
    ptx = Path(f"/tmp/omniloop-{fn.__name__}-{len(RESULTS)}.ptx")
    ptx.write_text(compiled.asm["ptx"])
    report = subprocess.run([str(_ptxas()), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", "/dev/null"],
                            capture_output=True, text=True)
    ptx.unlink()
    assert report.returncode == 0, report.stderr[-2000:]
    regs = int(re.search(r"Used (\d+) registers", report.stderr).group(1))
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", report.stderr))
    RESULTS.append(dict(kernel=fn.__name__, registers=regs, spill_bytes=spills, shared=compiled.metadata.shared,
                        options=options, constexprs={fn.arg_names[k[0]]: v for k, v in constexprs.items()
                                                     if isinstance(v, (int, str))}))
    print(RESULTS[-1], flush=True)


def _intercept(self: JITFunction, *args, grid, warmup, **kwargs):
    _compile(self, args, dict(kwargs))


def launch_all() -> None:
    from omniloop.gpu.kernels.add_rms_norm import add_rms_norm
    from omniloop.gpu.kernels.counter_hash import counter_uniform_cuda
    from omniloop.gpu.kernels.decode_attention import decode_attention, decode_attention_fresh
    from omniloop.gpu.kernels.packed_attention import packed_attention
    from omniloop.gpu.kernels.qk_norm_rope import norm_rope, qk_norm_rope, qk_norm_rope_cache, rope
    from omniloop.gpu.kernels.sampler import sample_rows
    from omniloop.gpu.kernels.silu_mul import silu_mul
    from omniloop.models.qwen3_tts.speech_layers import SnakeBeta

    bf = torch.bfloat16
    rows = 64
    for hidden, inter in ((2048, 6144), (1024, 3072)):  # talker, code predictor
        x = torch.empty(rows, hidden, dtype=bf)
        g = torch.empty(hidden, dtype=bf)
        add_rms_norm(x, torch.empty_like(x), g, 1e-6)
        add_rms_norm(torch.empty(4, rows, hidden), torch.empty_like(x), g, 1e-6)  # float32 partial sums
        silu_mul(torch.empty(rows, 2 * inter, dtype=bf))
    codec_tokens = 64 * 8  # the codec decoder's transformer: layer-scaled adds + norms, q/k RoPE (no norm)
    x = torch.empty(codec_tokens, 1024, dtype=bf)
    add_rms_norm(x, torch.empty_like(x), torch.empty(1024, dtype=bf), 1e-5, scale=torch.empty(1024, dtype=bf))
    rope(torch.empty(64, 8, 16, 64, dtype=bf), torch.empty(codec_tokens, 64, dtype=bf),
         torch.empty(codec_tokens, 64, dtype=bf))
    heads, kv_heads, d, slots, max_len = 16, 8, 128, 64, 1024
    qkv = torch.empty(rows, 1, (heads + 2 * kv_heads) * d, dtype=bf)
    w = torch.empty(d, dtype=bf)
    cos, sin = torch.empty(rows, d, dtype=bf), torch.empty(rows, d, dtype=bf)
    k_cache = torch.empty(slots, kv_heads, max_len + 1, d, dtype=bf)
    v_cache = torch.empty_like(k_cache)
    positions = torch.zeros(rows, 1, dtype=torch.int64)
    slot_ids = torch.arange(rows)
    qk_norm_rope(qkv, heads, kv_heads, w, w, 1e-6, cos, sin)
    qk_norm_rope_cache(qkv, heads, kv_heads, w, w, 1e-6, cos, sin, k_cache, v_cache, positions, slot_ids)
    prefill = torch.empty(4, 512, (heads + 2 * kv_heads) * d, dtype=bf)  # a prefill call: 16 tokens a program
    pcos, psin = torch.empty(4 * 512, d, dtype=bf), torch.empty(4 * 512, d, dtype=bf)
    qk_norm_rope_cache(prefill, heads, kv_heads, w, w, 1e-6, pcos, psin, k_cache, v_cache,
                       torch.zeros(4, 512, dtype=torch.int64), torch.arange(4), keep_keys=True)
    qk_norm_rope_cache(prefill, heads, kv_heads, w, w, 1e-6, pcos, psin, k_cache, v_cache,
                       torch.zeros(4, 512, dtype=torch.int64), torch.arange(4))  # a later prefill piece: no keys kept
    norm_rope(torch.empty(rows, 1, heads, d, dtype=bf), w, 1e-6, cos, sin)
    packed = torch.empty(4096, 1, heads + kv_heads, d, dtype=bf)  # a packed prefill: q and kept keys
    packed_attention(packed[:, 0, :heads], packed[:, 0, heads:], torch.empty(4096, kv_heads, d, dtype=bf),
                     torch.zeros(4096, dtype=torch.int64))
    q = qkv[..., :heads * d].view(rows, 1, heads, d)
    decode_attention(q, k_cache, v_cache, 256, positions[:, 0] + 1, slot_ids)  # talker decode
    cp_q = torch.empty(rows, 2, heads, d, dtype=bf)
    cp_k = torch.empty(rows, kv_heads, 17, d, dtype=bf)
    decode_attention(cp_q, cp_k, torch.empty_like(cp_k), 2)  # code predictor's first step
    decode_attention_fresh(qkv, heads, kv_heads, w, w, 1e-6, cos, sin, k_cache, v_cache, positions, 256,
                           positions[:, 0] + 1, slot_ids)  # talker decode, q/k norm+rope and KV write inside
    cp_qkv = torch.empty(rows, 2, (heads + 2 * kv_heads) * d, dtype=bf)
    decode_attention_fresh(cp_qkv, heads, kv_heads, w, w, 1e-6, cos[:2], sin[:2], cp_k, torch.empty_like(cp_k), 0, 2)
    for vocab in (3072, 2048):
        logits = torch.empty(rows, vocab, dtype=torch.float32)
        sample_rows(logits, torch.ones(rows, dtype=torch.bool), torch.ones(rows), torch.full((rows,), 50),
                    torch.ones(rows), torch.empty(rows, vocab))
    counter_uniform_cuda(torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64), 1, 15, 2048)
    snake = SnakeBeta(96)
    for channels_last in (True, False):  # the codec's convs run either layout (forward picks it on CUDA)
        act = torch.empty(8, 96, 1920 * 8, dtype=bf)
        snake._fused(act, torch.empty_like(act), channels_last)
        snake._fused(act, torch.empty_like(act), channels_last, torch.empty(96, dtype=bf))  # + a conv's bias


if __name__ == "__main__":
    JITFunction.run = _intercept
    launch_all()
    spilling = [r for r in RESULTS if r["spill_bytes"]]
    assert not spilling, f"kernels spill registers on sm_90a: {spilling}"
    print(f"kernels compile ({len(RESULTS)} variants for sm_90a)")
