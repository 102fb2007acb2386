"""Rows where a sampler that finds its top-k / top-p cuts without sorting could go wrong, each repeated with
fresh Gumbel noise so that a wrong cut shows up as a different token. Shared by the interpreter check
(``kernels_interpret_check.py``) and the GPU test (``test_kernels_gpu.py``). Every top-p cut here sits far
from a rounding boundary, so the fused sampler must pick exactly the torch path's token on every row."""

from __future__ import annotations

import torch

from omniloop.models.qwen3_tts.sampling import gumbel_noise


def edge_rows(vocab: int, repeats: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """``sample_noisy``'s arguments (CPU tensors) for ``vocab >= 16`` ids."""
    gen = torch.Generator().manual_seed(seed)
    neg_inf = float("-inf")
    rows = []  # (logits [vocab], do_sample, temperature, top_k, top_p)

    def add(logits: torch.Tensor, top_k: int, top_p: float = 1.0, temperature: float = 1.0,
            do_sample: bool = True) -> None:
        rows.append((logits.clone(), do_sample, temperature, top_k, top_p))

    equal = torch.full((vocab,), 0.7)
    add(equal, 1)  # every id ties with the k-th: all kept
    add(equal, 0, top_p=0.3)  # the first of a tied group has no mass before it: all kept
    add(equal - 3.2, 5, temperature=0.4)
    add(equal, 3, do_sample=False)  # greedy: the first of the ties
    lone = torch.full((vocab,), neg_inf)
    lone[vocab // 2] = -4.0
    add(lone, 10)  # the k-th value is -inf: everything kept, only the finite id can win
    few = torch.full((vocab,), neg_inf)
    few[[1, 5, vocab - 1]] = torch.tensor([1.0, 1.0, 0.0])
    add(few, 0, top_p=0.5)  # the tied pair (mass 0.42 each) is kept, the third (before 0.84) is not
    add(few, 2, temperature=2.5)
    tied = torch.randn(vocab, generator=gen) - 6
    tied[torch.randperm(vocab, generator=gen)[:10]] = 1.5
    add(tied, 4)  # ten-way tie across the k-th place
    add(tied, 11)  # the k-th is the best value below the tie
    add(tied, 0, top_p=0.2)  # the tie holds most of the mass: all ten kept, nothing else
    zeros = torch.zeros(vocab)
    zeros[::2] = -0.0
    zeros[:3] = 2.0
    add(zeros, 5)  # the k-th is a zero: -0.0 and +0.0 are the same value, all kept
    add(-zeros, 4)  # the same with the zeros on top
    wide = torch.randn(vocab, generator=gen) * 10.0 ** torch.randint(-20, 20, (vocab,), generator=gen)
    add(wide, 7, temperature=0.37)  # values spread over forty orders of magnitude, both signs
    add(wide, 1)
    plain = torch.randn(vocab, generator=gen) * 3
    add(plain, vocab)  # top-k at or past the vocabulary is off
    add(plain, vocab + 7, temperature=1.7)
    add(plain, vocab - 1)
    add(plain, 50, temperature=0.9)
    add(plain, 1, temperature=0.3)
    add(plain, 0, do_sample=False)

    logits = torch.stack([r[0] for r in rows]).repeat(repeats, 1)
    b = logits.shape[0]
    params = [torch.tensor([r[i] for r in rows]).repeat(repeats) for i in range(1, 5)]
    return dict(logits=logits, do_sample=params[0], temperature=params[1].float(), top_k=params[2],
                top_p=params[3].float(), noise=gumbel_noise(torch.rand(b, vocab, generator=gen)))
