"""Sampling edges a mutation run found unchecked (docs/testing.md), each with its expectation worked out by hand.

- the nucleus (top-p) cut-off exactly at p: the kept tokens hold at least p, and not one token more. Equal logits
  give probabilities that are exact in binary (1/2, 1/4, 1/8), so the running sum lands exactly on p: a token whose
  higher-ranked tokens already hold p is dropped, even when it ties with a kept one;
- the repetition penalty at 2.0, with one previous token, with int32 ids; the one-off `sample`;
- StopChecker before any stop, pushes without text, `finish` releasing held text once, and two stop strings found
  at the same place;
- a sampler without a seed (seeded from the OS), and top-k 1 called directly.
"""

from __future__ import annotations

import pytest
import torch

from hivekeeper.core.runtime.sampling import (Sampler, SamplingParams, StopChecker, apply_repetition_penalty,
                                              apply_top_k, apply_top_p, sample)


# ---- top-p at the cut-off -------------------------------------------------------------------------------------------
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


# ---- repetition penalty and the one-off sample ------------------------------------------------------------------
LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0]])


@pytest.mark.parametrize("previous, expected", [
    ([[0]], [[1.0, -1.0, 0.5, 3.0]]),  # one previous token, positive: halved
    ([[1]], [[2.0, -2.0, 0.5, 3.0]]),  # negative: doubled
    ([[3, 1, 3]], [[2.0, -2.0, 0.5, 1.5]]),  # repeats count once
])
def test_a_penalty_of_2_by_hand_with_int32_ids(previous, expected):
    ids = torch.tensor(previous, dtype=torch.int32)  # token ids as a tokenizer may hand them over
    assert torch.equal(apply_repetition_penalty(LOGITS, ids, 2.0), torch.tensor(expected))
    assert torch.equal(apply_repetition_penalty(LOGITS, ids, 1.0), LOGITS)  # 1.0: off


def test_one_off_sample_applies_the_params_and_the_penalty():
    previous = torch.tensor([[3]])
    # greedy: 3.0 halved to 1.5 loses to 2.0
    assert sample(LOGITS, SamplingParams(temperature=0, repetition_penalty=2.0), previous).tolist() == [0]
    assert sample(LOGITS, SamplingParams(temperature=0)).tolist() == [3]
    params = SamplingParams(temperature=1.0, seed=9, repetition_penalty=2.0)
    many = LOGITS.repeat(500, 1)
    assert torch.equal(sample(many, params, previous.repeat(500, 1)), Sampler(params)(many, previous.repeat(500, 1)))


# ---- StopChecker -------------------------------------------------------------------------------------------------
def test_stop_checker_before_a_stop_and_pushes_without_text():
    checker = StopChecker(eos_ids=[2], stop_strings=["###"])
    assert (checker.stopped, checker.reason, checker.matched) == (False, None, None)
    assert checker.push(5) == ""  # a token whose text the decoder has not released yet
    assert checker.push(6, "a#") == "a"  # "#" may start "###": held
    assert checker.push(7) == "" and not checker.stopped
    assert checker.finish() == "#"  # released once
    assert checker.finish() == ""


def test_two_stop_strings_at_the_same_place_report_the_first_listed():
    checker = StopChecker(stop_strings=["ab", "abc"])
    assert checker.push(1, "xabcd") == "x"
    assert checker.stopped and checker.matched == "ab"


# ---- without a seed, and top-k 1 ----------------------------------------------------------------------------------
def test_without_a_seed_each_sampler_draws_its_own_tokens():
    flat = torch.zeros(16, 1000)  # 16 uniform draws from 1000 tokens: two samplers agree on all with p = 1e-48
    first, second = Sampler(SamplingParams()), Sampler(SamplingParams())
    drawn = first(flat)
    assert drawn.shape == (16,) and ((drawn >= 0) & (drawn < 1000)).all()
    assert not torch.equal(drawn, second(flat))


def test_top_k_1_keeps_only_the_largest():
    logits = torch.tensor([[0.5, 3.0, 2.9, -1.0]])
    assert torch.isfinite(apply_top_k(logits, 1)).tolist() == [[False, True, False, False]]
