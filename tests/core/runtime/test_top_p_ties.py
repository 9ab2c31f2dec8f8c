"""The nucleus (top-p) cut-off exactly at p: the kept tokens hold at least p, and not one token more.

Equal logits give probabilities that are exact in binary (1/2, 1/4, 1/8), so the running sum lands exactly on p:
a token whose higher-ranked tokens already hold p is dropped, even when it ties with a kept one.
"""

from __future__ import annotations

import pytest
import torch

from hivekeeper.core.runtime.sampling import Sampler, SamplingParams, apply_top_p


@pytest.mark.parametrize("vocab, p, kept", [(2, 0.5, 1), (4, 0.5, 2), (4, 0.75, 3), (8, 0.25, 2), (8, 0.375, 3)])
def test_top_p_stops_where_the_kept_mass_reaches_p_exactly(vocab, p, kept):
    logits = torch.zeros(3, vocab)  # every token 1/vocab: k tokens hold exactly k/vocab
    filtered = apply_top_p(logits, p)
    assert (torch.isfinite(filtered).sum(dim=-1) == kept).all()
    assert kept / vocab == p  # the cut-off is exactly at p, the case in question


def test_a_tie_at_the_cut_off_is_never_sampled():
    """Probabilities 1/2, 1/4, 1/4 with p = 3/4: the two 1/4 tokens tie, the first of them completes 3/4, the other
    must never be drawn."""
    logits = torch.tensor([[2.0, 1.0, 1.0]]).log()  # exactly 1/2, 1/4, 1/4 after the softmax
    kept = torch.isfinite(apply_top_p(logits, 0.75))[0]
    assert kept[0] and kept.sum() == 2
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=5))
    draws = sampler(logits.repeat(4000, 1))
    dropped = int(torch.nonzero(~kept)[0])
    assert dropped not in draws.tolist()
    assert abs((draws == 0).float().mean().item() - 2 / 3) < 0.04  # kept odds 1/2 : 1/4, about 5 standard deviations
