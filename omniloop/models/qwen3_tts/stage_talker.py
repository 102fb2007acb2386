"""The Qwen3-TTS talker stage: ``ArScheduler`` (logical) + ``TalkerRunner`` (physical) over one model.

Admission (``prepare``, on the actor's loop): validate, tokenize, decode the reference audio, and work
out the prefill length without touching the model. The heavy per-request work — speaker embedding and
reference codes of a Base request, and the prompt embeddings — happens in the runner's step, through the
payload's lazy ``inputs`` (see ``voice.py``), so the loop never runs a model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omniloop.errors import RequestError
from omniloop.models.qwen3_tts.audio import load_audio
from omniloop.models.qwen3_tts.checkpoint import build_model
from omniloop.models.qwen3_tts.config import TtsConfig
from omniloop.models.qwen3_tts.family import resolve_checkpoint
from omniloop.models.qwen3_tts.generate import tts_input_from_request
from omniloop.models.qwen3_tts.prompt import Prompt, TtsInput, prompt_length
from omniloop.models.qwen3_tts.tokenizer import TextTokenizer, assistant_text, instruct_text, ref_text
from omniloop.models.qwen3_tts.validate import validate_speech_request
from omniloop.models.qwen3_tts.voice import VoiceEncoder
from omniloop.log import get_logger
from omniloop.models.registry import Worker
from omniloop.scheduler.ar import ArConfig, ArScheduler
from omniloop.scheduler.request import ArPrompt
from omniloop.transport.messages import SpeechRequest, Submit

SAMPLES_PER_FRAME = 1920
log = get_logger(__name__)
DEFAULT_MAX_MODEL_LEN = 4096  # positions per request (prompt + frames): ~5 minutes of audio
BLOCK_SIZE = 16


@dataclass
class TalkerPayload:
    """What the runner needs to start a request's slot. ``inputs`` resolves the reference voice on first
    use (in the runner's step), so the event loop never runs the speaker or speech encoder."""

    base: TtsInput  # token ids and sampling; x_vector / ref_code not yet filled for Base
    ref_pcm: np.ndarray | None = None
    voice: VoiceEncoder | None = None
    prompt: Prompt | None = None
    _inputs: TtsInput | None = field(default=None, repr=False)

    @property
    def inputs(self) -> TtsInput:
        if self._inputs is None:
            resolved = self.base
            if self.ref_pcm is not None:
                if self.voice is None:
                    raise RuntimeError("a Base request reached a talker without a voice encoder")
                x_vector, ref_code = self.voice.encode(self.ref_pcm, with_codes=self.base.ref_ids is not None)
                resolved = dataclasses.replace(self.base, x_vector=x_vector, ref_code=ref_code)
            self._inputs = resolved
        return self._inputs


class TalkerAdmission:
    """``prepare(req_id, submit, arrays) -> ArPrompt`` for the scheduler: everything cheap, nothing on
    the model. Errors raised here end the request with a clear message (the scheduler reports them)."""

    def __init__(self, cfg: TtsConfig, tokenizer: TextTokenizer, voice: VoiceEncoder | None,
                 max_model_len: int, max_text_chars: int, max_ref_seconds: float) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.voice = voice
        self.max_model_len = max_model_len
        self.max_text_chars = max_text_chars
        self.max_ref_seconds = max_ref_seconds

    def prefetch(self, submits: list[Submit]) -> None:
        """Tokenize the texts of many arrivals at once (``TextTokenizer.warm``) before they are prepared one by
        one; texts the checks would refuse (not a string, empty, over the length limit) are left to them."""
        texts: list[str] = []
        for submit in submits:
            req = submit.request
            if not isinstance(req, SpeechRequest):
                continue
            for text, template in ((req.text, assistant_text), (req.instructions, instruct_text),
                                   (req.ref_text, ref_text)):
                if isinstance(text, str) and text.strip() and len(text) <= self.max_text_chars:
                    texts.append(template(text))
        self.tokenizer.warm(texts)

    def __call__(self, req_id: str, submit: Submit, arrays: dict[str, Any]) -> ArPrompt:
        req = submit.request
        if not isinstance(req, SpeechRequest):
            raise RequestError(400, "the Qwen3-TTS talker takes speech requests only")
        validate_speech_request(self.cfg, req, self.max_text_chars)
        base = tts_input_from_request(self.cfg, self.tokenizer, req)
        ref_pcm, num_ref_frames = None, 0
        if base.task == "base":
            if self.voice is None:
                raise RequestError(400, "this talker was started without the Base voice encoder")
            try:
                ref_pcm = load_audio(req.ref_audio, max_seconds=self.max_ref_seconds)
            except ValueError as exc:
                raise RequestError(400, f"ref_audio: {exc}") from None
            if len(ref_pcm) < SAMPLES_PER_FRAME:
                # the speaker encoder's front end needs more; caught inside the batched step it would fail
                # every request in that step
                raise RequestError(400, f"ref_audio: {len(ref_pcm) / 24000 * 1000:.0f} ms of audio is too short; "
                                        f"give at least {SAMPLES_PER_FRAME / 24000 * 1000:.0f} ms")
            if base.ref_ids is not None:
                num_ref_frames = math.ceil(len(ref_pcm) / SAMPLES_PER_FRAME)
        num_prompt = prompt_length(self.cfg, base, num_ref_frames)
        room = self.max_model_len - num_prompt
        # the trailing text (added one position per frame) lives in a per-slot buffer of max_model_len rows
        if room < 2 or base.input_ids.numel() >= self.max_model_len:
            raise RequestError(400, f"the prompt takes {num_prompt} positions; this talker holds at most "
                                    f"{self.max_model_len} per request (max_model_len)")
        max_frames = min(base.max_new_tokens - 1, room - 1)
        payload = TalkerPayload(base=base, ref_pcm=ref_pcm, voice=self.voice)
        return ArPrompt(num_prompt_tokens=num_prompt, max_frames=max_frames, payload=payload)


def _torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_talker(stage: Any, profile: Any) -> Worker:
    from omniloop.gpu.prefill_graphs import check_token_buckets
    from omniloop.gpu.talker_runner import TalkerRunner

    ckpt = resolve_checkpoint(profile)
    opts = dict(stage.options)
    max_model_len = int(opts.pop("max_model_len", DEFAULT_MAX_MODEL_LEN))
    use_graphs = bool(opts.pop("cuda_graphs", stage.device.startswith("cuda")))
    prefill_graphs = bool(opts.pop("prefill_cuda_graphs", use_graphs))
    max_ref_seconds = float(opts.pop("max_ref_seconds", 60.0))
    token_buckets = opts.pop("prefill_token_buckets", None)  # given: the padded prefill graphs with these
    try:
        token_buckets = check_token_buckets(token_buckets) if token_buckets is not None else None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"stage {stage.name!r}: option prefill_token_buckets: {exc}") from None
    if opts:
        raise ValueError(f"stage {stage.name!r}: unknown options {sorted(opts)} for qwen3_tts.talker (known: "
                         "max_model_len, cuda_graphs, prefill_cuda_graphs, prefill_token_buckets, max_ref_seconds)")
    model, _ = build_model(ckpt.path, load_format=ckpt.load_format, device=stage.device,
                           dtype=_torch_dtype(stage.dtype), seed=profile.seed)
    cfg = model.cfg
    voice = (VoiceEncoder(ckpt.path, ckpt.load_format, stage.device, seed=profile.seed)
             if cfg.model_type == "base" else None)
    runner = TalkerRunner(model, device=stage.device, max_num_seqs=stage.max_num_seqs,
                          max_len=max_model_len, use_cuda_graphs=use_graphs,
                          gpu_memory_fraction=stage.gpu_memory_fraction, stage=stage.name,
                          prefill_graphs=prefill_graphs, prefill_token_buckets=token_buckets)
    if torch.device(stage.device).type == "cuda":
        log.info("talker_ready_on_gpu", stage=stage.name, max_num_seqs=stage.max_num_seqs, max_model_len=max_model_len,
                 reserved_gib=round(torch.cuda.memory_reserved(stage.device) / 2**30, 2))
    tokenizer = TextTokenizer.from_dir(ckpt.path)
    tokenizer.start_threads()
    admission = TalkerAdmission(cfg, tokenizer, voice, max_model_len, profile.max_text_chars, max_ref_seconds)
    blocks_per_seq = math.ceil(max_model_len / BLOCK_SIZE)
    scheduler = ArScheduler(
        ArConfig(stage=stage.name, max_num_seqs=stage.max_num_seqs, max_num_tokens=stage.max_num_tokens,
                 num_kv_blocks=blocks_per_seq * stage.max_num_seqs, block_size=BLOCK_SIZE,
                 max_codec_frames=profile.chunking.max_codec_frames),
        prepare=admission,
    )
    return Worker(scheduler, runner)
