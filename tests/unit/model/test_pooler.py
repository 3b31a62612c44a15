"""The pooler on hand-made hidden states: which rows each pooling method reads, when a vector
is final, and the embedding head's Matryoshka cut and normalisation per request."""

from __future__ import annotations

import pytest
import torch

from engine.model.pooler import PoolingMetadata, pooler_for_embed
from engine.pooling_params import PoolingParams

# Two requests in one step: "a" 3 tokens (rows 0-2), "b" 2 tokens (rows 3-4); hidden size 4.
HIDDEN = torch.tensor(
    [[1.0, 0, 0, 0], [3.0, 0, 0, 0], [5.0, 4, 0, 0], [0, 0, 2.0, 0], [0, 0, 0, 6.0]]
)  # (5 tokens, 4)


def metadata(prompt_lens, num_scheduled, seq_lens, params=None) -> PoolingMetadata:
    params = params or [PoolingParams(task="embed", use_activation=False)] * len(prompt_lens)
    meta = PoolingMetadata(prompt_lens=prompt_lens, pooling_params=params)
    meta.build_pooling_cursor(num_scheduled, seq_lens, torch.device("cpu"))
    return meta


@pytest.mark.parametrize(
    "pooling, expected",
    [
        ("LAST", [[5.0, 4, 0, 0], [0, 0, 0, 6.0]]),
        ("CLS", [[1.0, 0, 0, 0], [0, 0, 2.0, 0]]),
        ("MEAN", [[3.0, 4 / 3, 0, 0], [0, 0, 1.0, 3.0]]),
    ],
)
def test_each_method_reads_its_rows(pooling, expected):
    out = pooler_for_embed(pooling)(HIDDEN, metadata([3, 2], [3, 2], [3, 2]))
    assert torch.allclose(torch.stack(out), torch.tensor(expected))
    assert all(v.dtype == torch.float32 for v in out)


def test_a_chunk_is_pooled_but_only_the_last_one_is_final():
    # "a" computes tokens 4-6 of a 6-token prompt (done); "b" the first 2 of 5 (a chunk).
    meta = metadata([6, 5], [3, 2], [6, 2])
    assert meta.get_pooling_cursor().get_finished_mask() == [True, False]
    out = pooler_for_embed("LAST")(HIDDEN, meta)
    assert out[0].tolist() == [5.0, 4, 0, 0]


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_mean_and_cls_refuse_a_partial_prompt(pooling):
    with pytest.raises(RuntimeError, match=f"partial prefill is not supported with {pooling} pooling"):
        pooler_for_embed(pooling)(HIDDEN, metadata([6, 2], [3, 2], [6, 2]))


def test_head_cuts_then_normalises_per_request():
    params = [PoolingParams(task="embed", use_activation=True, dimensions=2),
              PoolingParams(task="embed", use_activation=False)]  # fmt: skip
    a, b = pooler_for_embed("LAST")(HIDDEN, metadata([3, 2], [3, 2], [3, 2], params))
    assert a.tolist() == pytest.approx([0.78086880, 0.62469504])  # [5, 4] / |[5, 4]|
    assert b.tolist() == [0, 0, 0, 6.0]  # raw: neither cut nor normalised
