"""Text tokenizer and the chat-style templates qwen-tts feeds the talker.

Loads ``tokenizer.json`` when the checkpoint has it; otherwise builds the Qwen2 byte-level BPE from
``vocab.json`` + ``merges.txt`` and the added tokens listed in ``tokenizer_config.json``. The prompt
builder slices the assistant template by position (role = ids[:3], text = ids[3:-5], ref text =
ref_ids[3:-2]), so "assistant" and "\\n" must be single tokens — checked at load.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from omniloop.models.qwen3_tts.config import ConfigError

QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def assistant_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"


def instruct_text(instruct: str) -> str:
    return f"<|im_start|>user\n{instruct}<|im_end|>\n"


def ref_text(text: str) -> str:
    return f"<|im_start|>assistant\n{text}<|im_end|>\n"


def _from_vocab_files(model_dir: Path) -> Tokenizer:
    vocab, merges = model_dir / "vocab.json", model_dir / "merges.txt"
    for f in (vocab, merges):
        if not f.exists():
            raise ConfigError(f"{f}: not found (and no tokenizer.json in {model_dir})")
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges), fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    cfg_path = model_dir / "tokenizer_config.json"
    added = {}
    if cfg_path.exists():
        with open(cfg_path, encoding="utf-8") as fh:
            added = json.load(fh).get("added_tokens_decoder", {}) or {}
    for idx, spec in sorted(added.items(), key=lambda kv: int(kv[0])):
        content = spec["content"]
        tok.add_special_tokens([AddedToken(content, special=bool(spec.get("special", True)),
                                           normalized=bool(spec.get("normalized", False)))])
        if tok.token_to_id(content) != int(idx):
            raise ConfigError(f"{cfg_path}: added_tokens_decoder.{idx} ({content!r}) got id "
                              f"{tok.token_to_id(content)}; ids must follow the vocab contiguously")
    return tok


class TextTokenizer:
    """The Qwen2 tokenizer with the templates above. ``warm(texts)`` encodes many texts in one ``encode_batch``
    (Rust threads, without the GIL) and keeps the ids for the ``encode`` calls until the next batch: a stage's loop
    thread tokenizing a wave of 64 arrivals one by one spent ~24 ms on the H200 host before its first plan."""

    def __init__(self, tokenizer: Tokenizer, source: str) -> None:
        self.tok = tokenizer
        self._warm: dict[str, list[int]] = {}  # text -> ids, from the last warm(); read (not taken) by encode
        for piece in ("assistant", "\n"):
            if len(self.tok.encode(piece, add_special_tokens=False).ids) != 1:
                raise ConfigError(f"{source}: {piece!r} is not a single token; the prompt layout needs it")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "TextTokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        tok = Tokenizer.from_file(str(path)) if path.exists() else _from_vocab_files(model_dir)
        return cls(tok, str(path if path.exists() else model_dir))

    def encode(self, text: str) -> torch.Tensor:
        ids = self._warm.get(text)  # kept, not taken: a batch's repeated texts (a bench's, a chorus) hit it too
        return torch.from_numpy(np.array(self.tok.encode(text).ids if ids is None else ids, dtype=np.int64))

    def warm(self, texts: list[str]) -> None:
        """Encode ``texts`` together for the ``encode`` calls that follow; the earlier batch is dropped, so this
        holds one batch at most."""
        self._warm.clear()
        distinct = list(dict.fromkeys(texts))
        if distinct:
            self._warm = {t: e.ids for t, e in zip(distinct, self.tok.encode_batch(distinct))}

    def start_threads(self) -> None:
        """Run one batch through ``encode_batch`` and drop it: its Rust thread pool starts here, not in the
        first burst of requests (a one-stream warm-up never batches)."""
        self.warm([assistant_text("warm"), assistant_text("up")])
        self._warm.clear()

    def assistant_ids(self, text: str) -> torch.Tensor:
        return self.encode(assistant_text(text))

    def instruct_ids(self, instruct: str | None) -> torch.Tensor | None:
        return self.encode(instruct_text(instruct)) if instruct else None

    def ref_ids(self, text: str | None) -> torch.Tensor | None:
        return self.encode(ref_text(text)) if text else None

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)
