"""Reference-voice processing for Base (voice clone) requests: the x-vector from the speaker encoder and,
for in-context cloning, the reference codes from the speech-tokenizer encoder — cached by content.

Owned by the talker stage and called from its runner's step (never from the event loop), when a
request is admitted; a voice used before costs one hash and a dict lookup.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from omniloop.models.qwen3_tts.ref_cache import RefCache, pcm_key
from omniloop.models.qwen3_tts.speaker_encoder import SpeakerEncoder
from omniloop.models.qwen3_tts.speech_tokenizer import SpeechTokenizer


class VoiceEncoder:
    def __init__(self, model_dir: Path, load_format: str, device: str, seed: int = 0,
                 cache: RefCache | None = None) -> None:
        self.speaker = SpeakerEncoder.load(model_dir, device=device, load_format=load_format, seed=seed)
        self.codec = SpeechTokenizer.load(model_dir, device=device, load_format=load_format, seed=seed).encoder
        if self.codec is None:
            raise ValueError(f"{model_dir}: the speech tokenizer has no encoder; Base cloning needs it")
        self.cache = cache or RefCache()

    @torch.no_grad()
    def encode(self, ref_pcm: np.ndarray, with_codes: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """24 kHz mono reference -> (x-vector [H], ref codes [R,16] or None)."""
        key = pcm_key(ref_pcm, codes=with_codes)
        entry = self.cache.get(key)
        if entry is None:
            x_vector = self.speaker.embed(ref_pcm)
            codes = self.codec.encode(ref_pcm).cpu().numpy() if with_codes else None
            entry = self.cache.put(key, x_vector, codes)
        codes = torch.from_numpy(np.array(entry.codes)) if entry.codes is not None else None
        return torch.from_numpy(np.array(entry.speaker)), codes

    def close(self) -> None:
        self.cache.clear()
