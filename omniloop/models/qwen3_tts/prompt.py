"""Per-request talker prompts, exactly as qwen-tts builds them (REFERENCE.md 3.3).

A prompt is ``[T(instruct)] + T(role) + (tts_pad.. tts_bos) + E_c(codec prefix)`` followed by the text
body, whose layout depends on the task and on ``non_streaming``; what is not consumed by the prompt
becomes the *trailing* text, added to the talker input one position per decode step. This runs once per
request at admission (a per-request loop is fine here), on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniloop.models.qwen3_tts.config import TtsConfig
from omniloop.models.qwen3_tts.talker import Qwen3TtsModel


@dataclass(frozen=True)
class TtsInput:
    """One request, resolved: token ids from ``tokenizer``, voice inputs from the audio side."""

    task: str  # custom_voice | voice_design | base
    input_ids: torch.Tensor  # int64 [N]: the assistant template (role 3 tokens, text, 5 closing tokens)
    language: str = "auto"
    speaker: str | None = None  # custom_voice
    instruct_ids: torch.Tensor | None = None  # int64 [M]: the instruct template
    ref_ids: torch.Tensor | None = None  # int64 [K]: the ref-text template (base in-context)
    x_vector: torch.Tensor | None = None  # float [H] (base)
    ref_code: torch.Tensor | None = None  # int64 [R, 16] (base in-context; None = x-vector only)
    non_streaming: bool | None = None  # None = the reference default for the task
    max_new_tokens: int = 2048
    sampling: dict | None = None  # SamplingParams fields for this request; None = greedy
    seed: int = 0

    @property
    def is_icl(self) -> bool:
        return self.task == "base" and self.ref_code is not None

    @property
    def streaming_text(self) -> bool:
        # generate_custom_voice / generate_voice_design default to non-streaming, generate_voice_clone to streaming
        if self.non_streaming is not None:
            return not self.non_streaming
        return self.task == "base"


@dataclass(frozen=True)
class Prompt:
    embeds: torch.Tensor  # [L, H] prefill input
    trailing: torch.Tensor  # [n, H] text added on decode steps 0..n-1 (then tts_pad)


def _language_id(model: Qwen3TtsModel, req: TtsInput) -> int | None:
    return language_id(model.cfg, req)


def language_id(cfg: TtsConfig, req: TtsInput) -> int | None:
    """The codec language id of the prompt prefix (None = "auto": the nothink prefix)."""
    tc = cfg.talker
    lang = (req.language or "auto").lower()
    lang_id = None if lang == "auto" else tc.codec_language_id.get(lang)
    if lang != "auto" and lang_id is None:
        raise ValueError(f"unknown language {req.language!r}; valid: {list(cfg.languages)}")
    if lang in ("chinese", "auto") and req.speaker:
        dialect = tc.spk_is_dialect.get(req.speaker.lower())
        if dialect is None:
            raise ValueError(f"speaker {req.speaker!r} has no spk_is_dialect entry in config.json")
        if dialect is not False:
            lang_id = tc.codec_language_id[dialect]
    return lang_id


def _speaker_embed(model: Qwen3TtsModel, req: TtsInput) -> torch.Tensor | None:
    if req.task == "base":
        if req.x_vector is None:
            raise ValueError("task 'base' needs the reference x-vector")
        return req.x_vector.to(model.device, model.dtype).reshape(1, -1)
    if req.speaker:
        spk = model.cfg.talker.spk_id.get(req.speaker.lower())
        if spk is None:
            raise ValueError(f"unknown speaker {req.speaker!r}; valid: {list(model.cfg.speakers)}")
        return model.codec_rows([spk])
    return None


def _icl_body(model: Qwen3TtsModel, req: TtsInput, text_ids: torch.Tensor, eos: torch.Tensor,
              pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tc = model.cfg.talker
    if req.ref_ids is None:
        raise ValueError("in-context cloning needs ref_ids (the reference transcript)")
    text = torch.cat((model.text_embed(torch.cat((req.ref_ids[3:-2], text_ids))), eos[None]), 0)
    ref_code = req.ref_code.to(model.device)
    codec = torch.cat((model.codec_rows([tc.codec_bos_id]), model.frame_embed(ref_code)), 0)
    if not req.streaming_text:
        text_part = text + model.codec_rows([tc.codec_pad_id])
        return torch.cat((text_part, codec + pad), 0), pad[None]
    if text.shape[0] > codec.shape[0]:
        return text[: codec.shape[0]] + codec, text[codec.shape[0]:]
    padded = torch.cat((text, pad.expand(codec.shape[0] - text.shape[0], -1)), 0)
    return padded + codec, pad[None]


@torch.no_grad()
def build_prompt(model: Qwen3TtsModel, req: TtsInput) -> Prompt:
    tc = model.cfg.talker
    bos, eos, pad = model.special_embeds()
    ids = req.input_ids.to(torch.int64).reshape(-1)
    if ids.shape[0] < 9:
        raise ValueError(f"input_ids has {ids.shape[0]} tokens; the assistant template alone has 8")
    lang_id = _language_id(model, req)
    prefix = ([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id] if lang_id is None
              else [tc.codec_think_id, tc.codec_think_bos_id, lang_id, tc.codec_think_eos_id])
    codec = [model.codec_rows(prefix)]
    speaker = _speaker_embed(model, req)
    if speaker is not None:
        codec.append(speaker)
    codec.append(model.codec_rows([tc.codec_pad_id, tc.codec_bos_id]))
    codec_t = torch.cat(codec, 0)
    n_codec = codec_t.shape[0]
    # text side of the prefix: tts_pad under every codec entry but the last two, tts_bos under the
    # second-to-last; the last codec entry (codec_bos) moves into the body
    head = torch.cat((pad.expand(n_codec - 2, -1), bos[None]), 0) + codec_t[:-1]
    parts = []
    if req.instruct_ids is not None and req.instruct_ids.numel() > 0:
        parts.append(model.text_embed(req.instruct_ids.reshape(-1)))
    parts += [model.text_embed(ids[:3]), head]
    text_ids = ids[3:-5]
    if req.is_icl:
        body, trailing = _icl_body(model, req, text_ids, eos, pad)
        parts.append(body)
    elif req.streaming_text:
        parts.append(model.text_embed(ids[3:4]) + codec_t[-1:])
        trailing = torch.cat((model.text_embed(ids[4:-5]), eos[None]), 0)
    else:
        text = torch.cat((model.text_embed(text_ids), eos[None]), 0)
        parts.append(text + model.codec_rows([tc.codec_pad_id]))
        parts.append(pad[None] + codec_t[-1:])
        trailing = pad[None]
    return Prompt(embeds=torch.cat(parts, 0), trailing=trailing)


def prompt_length(cfg: TtsConfig, req: TtsInput, num_ref_frames: int = 0) -> int:
    """``build_prompt(model, req).embeds.shape[0]`` without the model, for admission (the scheduler needs
    the prefill length before any weights are touched). ``num_ref_frames``: reference code frames of an
    in-context clone (``ceil(ref samples / 1920)``); ``req.ref_code`` may still be None then."""
    n_codec = (3 if language_id(cfg, req) is None else 4) + 2
    if req.task == "base" or req.speaker:
        n_codec += 1  # the speaker slot: x-vector (base) or the speaker's codec embedding
    n = 3 + (n_codec - 1)
    if req.instruct_ids is not None and req.instruct_ids.numel() > 0:
        n += int(req.instruct_ids.numel())
    num_text = int(req.input_ids.numel()) - 8
    is_icl = req.task == "base" and (req.ref_code is not None or num_ref_frames > 0)
    if is_icl:
        if req.ref_ids is None:
            raise ValueError("in-context cloning needs ref_ids (the reference transcript)")
        frames = int(req.ref_code.shape[0]) if req.ref_code is not None else num_ref_frames
        num_text_icl = int(req.ref_ids.numel()) - 5 + num_text + 1
        return n + (num_text_icl + 1 + frames if not req.streaming_text else 1 + frames)
    if req.streaming_text:
        return n + 1
    return n + num_text + 1 + 1
