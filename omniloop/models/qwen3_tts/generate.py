"""A batched generation loop over the step API of ``Qwen3TtsModel`` (see ``talker.py``), used by tests and
the one-shot CLI. The engine runner drives the same steps itself.

All requests are prefilled together; each step samples one frame for every live request and decodes
the next talker position for those still running. A request leaves the batch when codebook 0 is EOS
("stop", the EOS frame excluded) or when it has produced ``max_new_tokens`` code-0 tokens ("length";
the last token's frame is never completed, so frames = tokens - 1, as in the reference).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from omniloop.models.qwen3_tts.config import TtsConfig
from omniloop.models.qwen3_tts.prompt import TtsInput, build_prompts
from omniloop.models.qwen3_tts.sampling import SamplingParams
from omniloop.models.qwen3_tts.talker import Qwen3TtsModel
from omniloop.models.qwen3_tts.tokenizer import TextTokenizer
from omniloop.transport.messages import Sampling, SpeechRequest

GREEDY = dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0,
              sub_do_sample=False, sub_temperature=1.0, sub_top_k=0, sub_top_p=1.0)


@dataclass(frozen=True)
class GenResult:
    codes: torch.Tensor  # int64 [T, 16], EOS frame excluded
    reason: str  # "stop" | "length"


def sampling_row(cfg: TtsConfig, sampling: Sampling) -> dict[str, float | int | bool]:
    """A request's ``Sampling`` with ``None`` fields filled from generation_config.json."""
    g = cfg.generation

    def pick(value: object, default: object) -> object:
        return default if value is None else value

    return dict(
        do_sample=pick(sampling.do_sample, g.do_sample), temperature=pick(sampling.temperature, g.temperature),
        top_k=pick(sampling.top_k, g.top_k), top_p=pick(sampling.top_p, g.top_p),
        repetition_penalty=pick(sampling.repetition_penalty, g.repetition_penalty),
        sub_do_sample=pick(sampling.sub_do_sample, g.sub_do_sample),
        sub_temperature=pick(sampling.sub_temperature, g.sub_temperature),
        sub_top_k=pick(sampling.sub_top_k, g.sub_top_k), sub_top_p=pick(sampling.sub_top_p, g.sub_top_p))


def tts_input_from_request(cfg: TtsConfig, tokenizer: TextTokenizer, req: SpeechRequest,
                           x_vector: torch.Tensor | None = None, ref_code: torch.Tensor | None = None) -> TtsInput:
    """Resolve a validated ``SpeechRequest``; ``x_vector`` / ``ref_code`` come from the audio side (base)."""
    task = req.task or cfg.model_type
    icl = task == "base" and not req.x_vector_only
    instructions = req.instructions if cfg.accepts_instructions else None
    seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(63)
    return TtsInput(
        task=task, input_ids=tokenizer.assistant_ids(req.text), language=(req.language or "auto").lower(),
        speaker=req.speaker.lower() if req.speaker and task == "custom_voice" else None,
        instruct_ids=tokenizer.instruct_ids(instructions) if task != "base" else None,
        ref_ids=tokenizer.ref_ids(req.ref_text) if icl else None,
        x_vector=x_vector if task == "base" else None, ref_code=ref_code if icl else None,
        max_new_tokens=req.max_frames + 1 if req.max_frames is not None else cfg.generation.max_new_tokens,
        sampling=sampling_row(cfg, req.sampling), seed=seed)


@torch.no_grad()
def generate(model: Qwen3TtsModel, requests: list[TtsInput]) -> list[GenResult]:
    device = model.device
    prompts = build_prompts(model, requests)
    for p in prompts:
        if isinstance(p, Exception):
            raise p
    lengths = [p.embeds.shape[0] for p in prompts]
    max_len = max(n + r.max_new_tokens for n, r in zip(lengths, requests))
    model.allocate(num_slots=len(requests), max_len=max_len,
                   max_trailing=max(p.trailing.shape[0] for p in prompts))
    for slot, p in enumerate(prompts):
        model.set_trailing(slot, p.trailing)
    rows = [dict(GREEDY if r.sampling is None else r.sampling, seed=r.seed) for r in requests]
    params_all = SamplingParams.stack(rows, device)

    live = list(range(len(requests)))
    slots = torch.tensor(live, device=device)
    hidden = model.prefill(slots, [p.embeds for p in prompts])
    frames: list[list[torch.Tensor]] = [[] for _ in requests]
    results: list[GenResult | None] = [None] * len(requests)
    step = 0  # every live request is at the same frame index: all were admitted together
    while live:
        step_t = torch.full((len(live),), step, dtype=torch.int64, device=device)
        codes = model.sample_frame(slots, hidden, params_all.index(slots), step_t)
        code0 = codes[:, 0].tolist()
        keep = []
        for i, r in enumerate(live):  # bookkeeping on plain ints; the model math stays batched
            if code0[i] == model.cfg.talker.codec_eos_id:
                results[r] = GenResult(_stack(frames[r], codes.shape[1]), "stop")
            elif step + 1 >= requests[r].max_new_tokens:
                results[r] = GenResult(_stack(frames[r], codes.shape[1]), "length")
            else:
                frames[r].append(codes[i].cpu())
                keep.append(i)
        if not keep:
            break
        keep_t = torch.tensor(keep, device=device)
        live = [live[i] for i in keep]
        slots, codes = slots[keep_t], codes[keep_t]
        embeds = model.next_input(slots, codes, step_t[keep_t])
        pos = [lengths[r] + step for r in live]
        hidden = model.decode_step(slots, embeds, torch.tensor(pos, device=device), kv_len=max(pos) + 1)
        step += 1
    return [r for r in results if r is not None]


def _stack(frames: list[torch.Tensor], num_groups: int) -> torch.Tensor:
    return torch.stack(frames) if frames else torch.zeros(0, num_groups, dtype=torch.int64)
