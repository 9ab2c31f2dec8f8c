"""Sampling filters, seeded reproducibility and stop conditions."""

from __future__ import annotations

import math

import pytest
import torch

from hivekeeper.core.runtime.sampling import (
    Sampler,
    SamplingParams,
    StopChecker,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
)
from hivekeeper.core.runtime.tokenizer import Tokenizer
from hivekeeper.planner.errors import InputError


def _random_logits(batch=4, vocab=100, seed=0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _random_logits()
    expected = logits.argmax(dim=-1)
    assert torch.equal(Sampler(SamplingParams(temperature=0))(logits), expected)
    # a bf16 input is compared in fp32 but still picks the row maximum
    assert torch.equal(Sampler(SamplingParams(temperature=0))(logits.bfloat16()), logits.bfloat16().float().argmax(-1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_1_is_greedy(seed):
    logits = _random_logits(seed=seed)
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=seed))
    for _ in range(5):
        assert torch.equal(sampler(logits), logits.argmax(dim=-1))


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5]])
    kept = torch.isfinite(apply_top_k(logits, 2))
    assert kept.tolist() == [[False, True, False, True, False]]
    assert torch.equal(apply_top_k(logits, 0), logits)


def test_top_p_masks_the_tail_of_a_hand_made_distribution():
    # probabilities 0.15, 0.5, 0.05, 0.3 (ranked: 0.5, 0.3, 0.15, 0.05), second row reversed order
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3], [0.3, 0.05, 0.5, 0.15]])
    logits = probs.log()

    def kept(p):
        return torch.isfinite(apply_top_p(logits, p)).tolist()

    assert kept(0.4) == [[False, True, False, False], [False, False, True, False]]  # 0.5 alone reaches 0.4
    assert kept(0.75) == [[False, True, False, True], [True, False, True, False]]  # 0.5 + 0.3 = 0.8 >= 0.75
    assert kept(0.85) == [[True, True, False, True], [True, False, True, True]]  # needs the 0.15 too
    assert kept(0.99) == [[True] * 4, [True] * 4]
    assert kept(0.01) == [[False, True, False, False], [False, False, True, False]]  # the top token always stays

    # sampling never picks a masked token, and keeps the kept tokens' relative odds (0.5 : 0.3)
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=3))
    draws = sampler(logits.repeat(2000, 1)).view(2000, 2)  # 2000 copies of both rows in one batch
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {0, 2}
    share_of_top = (draws[:, 0] == 1).float().mean().item()
    assert abs(share_of_top - 0.5 / 0.8) < 0.04  # about 3.7 standard deviations


def test_temperature_flattens_the_distribution():
    logits = torch.tensor([[0.0, math.log(3.0)]])  # odds 1 : 3 at temperature 1
    sampler = Sampler(SamplingParams(temperature=2.0, seed=11))
    share = sampler(logits.repeat(4000, 1)).float().mean().item()
    expected = math.sqrt(3) / (1 + math.sqrt(3))  # odds 1 : sqrt(3) at temperature 2
    assert abs(share - expected) < 0.03


def test_a_fixed_seed_reproduces_a_generation():
    logits = [_random_logits(batch=2, vocab=1000, seed=s) for s in range(40)]

    def generate(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=seed))
        out = []
        for step_logits in logits:
            torch.manual_seed(len(out))  # the global generator must not matter
            torch.rand(3)
            out.append(sampler(step_logits))
        return torch.stack(out)

    assert torch.equal(generate(7), generate(7))
    assert not torch.equal(generate(7), generate(8))
    # the generator advances from step to step (it is not re-seeded per call)
    sampler = Sampler(SamplingParams(seed=7))
    flat = torch.zeros(8, 1000)
    assert not torch.equal(sampler(flat), sampler(flat))


def test_repetition_penalty_matches_transformers():
    transformers_generation = pytest.importorskip("transformers.generation.logits_process")
    logits = _random_logits(batch=3, vocab=50, seed=5)  # positive and negative logits
    previous = torch.tensor([[1, 2, 2, 7, 49], [0, 0, 0, 0, 0], [10, 3, 30, 3, 10]])
    for penalty in (1.3, 0.7):
        reference = transformers_generation.RepetitionPenaltyLogitsProcessor(penalty)(previous, logits.clone())
        ours = apply_repetition_penalty(logits, previous, penalty)
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)
        untouched = torch.ones_like(logits, dtype=torch.bool).scatter(-1, previous, False)
        assert torch.equal(ours[untouched], logits[untouched])
    # and the sampler applies it before choosing: greedy picks the argmax of the penalized logits
    reference = transformers_generation.RepetitionPenaltyLogitsProcessor(5.0)(previous, logits.clone())
    chosen = Sampler(SamplingParams(temperature=0, repetition_penalty=5.0))(logits, previous)
    assert torch.equal(chosen, reference.argmax(-1))


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -0.1), ("temperature", float("nan")), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5),
     ("repetition_penalty", 0.0), ("seed", -3)],
)
def test_bad_sampling_params(field, value):
    with pytest.raises(InputError, match=field):
        SamplingParams(**{field: value})


# ---- stopping ----------------------------------------------------------------------------------------------------
def test_stop_checker_eos():
    checker = StopChecker(eos_ids=[2, 9])
    assert checker.push(5, "Hello") == "Hello" and not checker.stopped
    assert checker.push(9, "") == "" and checker.stopped and checker.reason == "eos"
    assert checker.push(5, "more") == ""


def test_stop_string_split_over_pieces_is_held_then_trimmed():
    checker = StopChecker(eos_ids=[2], stop_strings=["\nUser:", "###"])
    shown = [checker.push(10, "Sure, here"), checker.push(11, " it is.\nUs"), checker.push(12, "er: next")]
    assert shown == ["Sure, here", " it is.", ""]  # "\nUs" might start a stop string: held back, then dropped
    assert checker.stopped and checker.reason == "stop_string" and checker.matched == "\nUser:"
    assert checker.finish() == ""


def test_held_text_is_released_when_it_is_not_a_stop_string():
    checker = StopChecker(stop_strings=["User:"])
    assert checker.push(1, "Ask the U") == "Ask the "
    assert checker.push(2, "ser") == ""  # "User" still might become "User:"
    assert checker.push(3, "s and") == "Users and"
    assert checker.push(4, " U") == " "
    assert checker.finish() == "U"  # generation ended (max tokens): nothing is lost
    assert not checker.stopped


def test_earliest_stop_string_wins_and_trim():
    checker = StopChecker(stop_strings=["END", "x"])
    assert checker.push(1, "abc x then END") == "abc " and checker.matched == "x"
    assert StopChecker(stop_strings=["END"]).trim("one END two END") == "one "
    assert StopChecker(stop_strings=["END"]).trim("nothing") == "nothing"


def test_stop_string_with_streamed_tokens(tiny_checkpoint):
    tokenizer = Tokenizer.from_folder(tiny_checkpoint)
    ids = tokenizer.encode("The keeper said: café!\nUser: and more", add_bos=False)
    decoder = tokenizer.stream_decoder()
    checker = StopChecker(tokenizer.eos_token_ids, ["\nUser:"])
    shown = ""
    for token_id in ids:
        shown += checker.push(token_id, decoder.feed(token_id))
        if checker.stopped:
            break
    assert shown == "The keeper said: café!"
    eos = tokenizer.eos_token_ids[0]
    checker = StopChecker(tokenizer.eos_token_ids)
    decoder = tokenizer.stream_decoder()
    shown = "".join(checker.push(t, decoder.feed(t)) for t in [*tokenizer.encode("bye", add_bos=False), eos, 45])
    assert shown == "bye" and checker.reason == "eos"
