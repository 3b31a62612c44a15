"""The sampler's greedy pick (engine/model/sampler.py): the first of tied maxima, as
transformers' ``argmax`` picks, whatever way the sampler finds it."""

from __future__ import annotations

import torch

from engine.model.sampler import Sampler, SamplingMetadata
from engine.sampling_params import SamplingParams


def _meta(rows: int, vocab: int, temperature: float = 0.0) -> SamplingMetadata:
    params = [SamplingParams(temperature=temperature, max_tokens=4)] * rows
    return SamplingMetadata.build(params, [[1, 2]] * rows, [[]] * rows, [None] * rows, [None] * rows, vocab,
                                  torch.device("cpu"))  # fmt: skip


def test_greedy_takes_the_first_of_tied_maxima_like_argmax():
    logits = torch.zeros(4, 16)
    logits[0, [3, 9]] = 5.0  # a tie: the lower id wins
    logits[1, [0, 15]] = 1.0
    logits[2, :] = 2.0  # all equal: id 0
    logits[3, 7] = -1.0  # the rest 0: id 0 (the first of 15 tied)
    out = Sampler()(logits, _meta(4, 16))
    assert out.sampled_token_ids.tolist() == [3, 0, 0, 0] == logits.argmax(dim=-1).tolist()


def test_greedy_equals_argmax_on_rounded_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 512, generator=g).to(torch.bfloat16).float()  # many near ties
    assert torch.equal(Sampler()(logits, _meta(64, 512)).sampled_token_ids, logits.argmax(dim=-1))
