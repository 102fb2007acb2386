"""Per-request talker prompts, exactly as qwen-tts builds them (REFERENCE.md 3.3).

A prompt is ``[T(instruct)] + T(role) + (tts_pad.. tts_bos) + E_c(codec prefix)`` followed by the text
body, whose layout depends on the task and on ``non_streaming``; what is not consumed by the prompt
becomes the *trailing* text, added to the talker input one position per decode step.

``build_prompts`` builds the prompts of all requests admitted in one step together: every row is
``T(text id) + C`` (C: nothing, a codec embedding, the x-vector or a reference frame), so the per-request
work is laying rows out on the host, and the device work is a fixed number of batched ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omniloop.gpu.host_copy import to_device
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


# the text source of a row: a text id >= 0, or one of the rows of ``special_embeds()`` (index -1 - code)
_BOS, _EOS, _PAD = -1, -2, -3
# the codec source of a row: a codec id >= 0, or none, the request's x-vector, or its next reference frame
_NO_CODEC, _XVEC, _FRAME = -1, -2, -3


@dataclass(frozen=True)
class _Rows:
    """One request's prompt on the host, one entry per row (REFERENCE.md 3.3: every row is T(text) + an
    optional codec part). The prompt rows come first, then the trailing rows (text only)."""

    text: np.ndarray  # int64 [num_prompt + num_trailing]
    codec: np.ndarray  # int64 [num_prompt + num_trailing] (_NO_CODEC on every trailing row)
    num_prompt: int
    x_vector: torch.Tensor | None  # [H] (task base)
    ref_code: torch.Tensor | None  # [R, 16] (in-context cloning)


def _text_ids(cfg: TtsConfig, t: torch.Tensor, name: str) -> np.ndarray:
    # tolist(), not numpy(): it dispatches no torch op, so the host side costs no aten call per request
    ids = np.asarray(t.tolist() if t.dim() == 1 else t.reshape(-1).tolist(), dtype=np.int64)
    vocab = cfg.talker.text_vocab_size
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):  # negative ids would read as the special rows
        raise ValueError(f"{name} holds ids outside the text vocab [0, {vocab})")
    return ids


def _speaker_slot(cfg: TtsConfig, req: TtsInput) -> list[int]:
    if req.task == "base":
        if req.x_vector is None:
            raise ValueError("task 'base' needs the reference x-vector")
        if req.x_vector.numel() != cfg.talker.decoder.hidden_size:
            raise ValueError(f"x_vector has {req.x_vector.numel()} values; the talker hidden size is "
                             f"{cfg.talker.decoder.hidden_size}")
        return [_XVEC]
    if req.speaker:
        spk = cfg.talker.spk_id.get(req.speaker.lower())
        if spk is None:
            raise ValueError(f"unknown speaker {req.speaker!r}; valid: {list(cfg.speakers)}")
        return [spk]
    return []


def _layout(cfg: TtsConfig, req: TtsInput) -> _Rows:
    """Where each row of ``req``'s prompt and trailing text comes from; raises the request's own errors."""
    tc = cfg.talker
    ids = _text_ids(cfg, req.input_ids, "input_ids")
    if ids.shape[0] < 9:
        raise ValueError(f"input_ids has {ids.shape[0]} tokens; the assistant template alone has 8")
    lang_id = language_id(cfg, req)
    prefix = ([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id] if lang_id is None
              else [tc.codec_think_id, tc.codec_think_bos_id, lang_id, tc.codec_think_eos_id])
    codec = np.asarray(prefix + _speaker_slot(cfg, req) + [tc.codec_pad_id, tc.codec_bos_id], dtype=np.int64)
    n_codec = codec.shape[0]
    instruct = np.zeros(0, dtype=np.int64)
    if req.instruct_ids is not None and req.instruct_ids.numel() > 0:
        instruct = _text_ids(cfg, req.instruct_ids, "instruct_ids")
    # [T(instruct)] + T(role), then the prefix: tts_pad under every codec entry but the last two, tts_bos under
    # the second-to-last; the last codec entry (codec_bos) moves into the body
    text = [instruct, ids[:3], [_PAD] * (n_codec - 2), [_BOS]]
    codecs = [np.full(instruct.shape[0] + 3, _NO_CODEC), codec[:-1]]
    body = ids[3:-5]
    bos_c, pad_c = tc.codec_bos_id, tc.codec_pad_id
    if req.is_icl:
        if req.ref_ids is None:
            raise ValueError("in-context cloning needs ref_ids (the reference transcript)")
        if req.ref_code.dim() != 2 or req.ref_code.shape[1] != tc.num_code_groups:
            raise ValueError(f"ref_code has shape {tuple(req.ref_code.shape)}; expected [frames, {tc.num_code_groups}]")
        ref_text = np.concatenate((_text_ids(cfg, req.ref_ids, "ref_ids")[3:-2], body, [_EOS]))
        ref_codec = np.asarray([bos_c] + [_FRAME] * req.ref_code.shape[0], dtype=np.int64)
        n_text, n_ref = ref_text.shape[0], ref_codec.shape[0]
        if not req.streaming_text:  # text + E_c(pad), then the codes + tts_pad
            text += [ref_text, [_PAD] * n_ref]
            codecs += [np.full(n_text, pad_c), ref_codec]
            trailing = [_PAD]
        elif n_text > n_ref:  # summed while both exist; the extra text trails
            text.append(ref_text[:n_ref])
            codecs.append(ref_codec)
            trailing = ref_text[n_ref:]
        else:
            text += [ref_text, [_PAD] * (n_ref - n_text)]
            codecs.append(ref_codec)
            trailing = [_PAD]
    elif req.streaming_text:
        text.append(ids[3:4])
        codecs.append([bos_c])
        trailing = np.concatenate((ids[4:-5], [_EOS]))
    else:
        text += [body, [_EOS, _PAD]]
        codecs += [np.full(body.shape[0] + 1, pad_c), [bos_c]]
        trailing = [_PAD]
    num_prompt = sum(len(c) for c in codecs)
    text_col = np.concatenate(text + [trailing]).astype(np.int64)
    codec_col = np.concatenate(codecs + [np.full(text_col.shape[0] - num_prompt, _NO_CODEC)]).astype(np.int64)
    x_vector = None
    if req.task == "base":
        x_vector = req.x_vector if req.x_vector.dim() == 1 else req.x_vector.reshape(-1)
    return _Rows(text=text_col, codec=codec_col, num_prompt=num_prompt, x_vector=x_vector,
                 ref_code=req.ref_code if req.is_icl else None)


def _check_ref_codes(cfg: TtsConfig, rows: dict[int, _Rows], out: list) -> np.ndarray:
    """All reference codes, in request order, as one host array; a request with a code outside the embedding
    tables fails alone (inside the batched gather it would fail every request, on CUDA the whole context)."""
    icl = [i for i, r in rows.items() if r.ref_code is not None]
    if not icl:
        return np.zeros((0, cfg.talker.num_code_groups), dtype=np.int64)
    codes = np.asarray(torch.cat([rows[i].ref_code for i in icl]).cpu().numpy(), dtype=np.int64)
    limit = np.full(codes.shape[1], cfg.talker.code_predictor.vocab_size)
    limit[0] = cfg.talker.decoder.vocab_size
    bad = ((codes < 0) | (codes >= limit)).any(1)
    keep = np.ones(codes.shape[0], dtype=bool)
    start = 0
    for i in icl:
        end = start + rows[i].ref_code.shape[0]
        if bad[start:end].any():
            out[i] = ValueError(f"ref_code holds codes outside the codebooks ([0, {limit[0]}) for codebook 0, "
                                f"[0, {limit[1]}) for the others)")
            keep[start:end] = False
            del rows[i]
        start = end
    return codes[keep]


@torch.no_grad()
def build_prompts(model: Qwen3TtsModel, reqs: list[TtsInput]) -> list[Prompt | Exception]:
    """The prompts of ``reqs``, in a number of torch ops that does not grow with ``len(reqs)``: the rows are
    laid out on the host, their indices cross in one int64 copy (x-vectors in one float copy), then one
    ``text_embed`` over the distinct text ids, one codec gather, one ``frame_embed`` over every reference
    code, one scatter per codec source and one add. A request-scoped error takes that request's place.

    Tensors of ``reqs`` are read on the host (a device tensor would be synchronized on)."""
    out: list[Prompt | Exception | None] = [None] * len(reqs)
    rows: dict[int, _Rows] = {}
    for i, req in enumerate(reqs):  # host only: no torch op per request
        try:
            rows[i] = _layout(model.cfg, req)
        except Exception as exc:  # noqa: BLE001 - this request's inputs; the others still get their prompts
            out[i] = exc
    codes = _check_ref_codes(model.cfg, rows, out)
    if not rows:
        return out
    good = list(rows)
    text = np.concatenate([rows[i].text for i in good])
    codec = np.concatenate([rows[i].codec for i in good])
    is_id = text >= 0
    distinct, inverse = np.unique(text[is_id], return_inverse=True)
    index = -1 - text  # rows 0..2 of the text table: special_embeds() (bos, eos, pad), reused bit-exact
    index[is_id] = 3 + inverse
    codec_rows = np.flatnonzero(codec >= 0)
    xvec_rows, frame_rows = np.flatnonzero(codec == _XVEC), np.flatnonzero(codec == _FRAME)
    host = (distinct, index, codec_rows, codec[codec_rows], xvec_rows, frame_rows, codes.reshape(-1))
    device, dtype = model.device, model.dtype
    dev = to_device(np.concatenate(host), device).split([a.shape[0] for a in host])
    distinct_d, index_d, codec_rows_d, codec_ids_d, xvec_rows_d, frame_rows_d, codes_d = dev
    table = torch.cat((model.special_embeds(), model.text_embed(distinct_d)))
    codec_part = torch.zeros(text.shape[0], table.shape[1], dtype=dtype, device=device)
    codec_part.index_copy_(0, codec_rows_d, model.codec_embed(codec_ids_d))
    if xvec_rows.size:
        x_vectors = torch.stack([rows[i].x_vector for i in good if rows[i].x_vector is not None])
        codec_part.index_copy_(0, xvec_rows_d, to_device(x_vectors, device).to(dtype))
    if frame_rows.size:
        codec_part.index_copy_(0, frame_rows_d, model.frame_embed(codes_d.view(-1, codes.shape[1])))
    # T + C; rows without a codec part add zeros, which leaves T unchanged
    embeds = table.index_select(0, index_d) + codec_part
    sizes = [n for i in good for n in (rows[i].num_prompt, rows[i].text.shape[0] - rows[i].num_prompt)]
    parts = embeds.split(sizes)
    for k, i in enumerate(good):
        out[i] = Prompt(embeds=parts[2 * k], trailing=parts[2 * k + 1])
    return out


def build_prompt(model: Qwen3TtsModel, req: TtsInput) -> Prompt:
    """``build_prompts`` of one request; raises its error."""
    (prompt,) = build_prompts(model, [req])
    if isinstance(prompt, Exception):
        raise prompt
    return prompt


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
