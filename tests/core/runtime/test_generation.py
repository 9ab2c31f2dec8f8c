"""The generation loop: greedy equals a hand-written argmax loop, streaming, stops (EOS, stop strings, the stop
flag, max_new_tokens, the context), sampling with a seed, timing, and a prompt too long for the context."""

from __future__ import annotations

import threading

import pytest
import torch

from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.placement import place_model
from hivekeeper.core.runtime.generation import GenerationResult, generate
from hivekeeper.core.runtime.model import ModelConfig
from hivekeeper.core.runtime.sampling import SamplingParams
from hivekeeper.core.runtime.tokenizer import Tokenizer
from hivekeeper.planner.costmodel import Placement, Policy
from hivekeeper.planner.errors import InputError


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def open_model(path, max_length=64, batch=1, weights=(0, 1, 0)) -> OffloadedModel:
    policy = Policy("fp32", Placement(*weights), Placement(0, 1, 0), Placement(0, 1, 0), prefetch_depth=1)
    plan = place_model(ModelConfig.from_folder(path), policy, device="cpu", dtype=torch.float32, batch=batch,
                       max_length=max_length)
    return OffloadedModel(path, plan)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    m = open_model(tiny_checkpoint, max_length=2048, batch=2, weights=(0, 0.5, 0.5))
    yield m
    m.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return Tokenizer.from_folder(tiny_checkpoint)


@torch.inference_mode()
def argmax_loop(model, prompt, steps):
    cache = model.span.allocate_cache(1, len(prompt) + steps)
    logits = model.head(model.span(model.embedding(torch.tensor([prompt])), cache))[:, -1]
    out = []
    for _ in range(steps):
        token = int(logits.argmax(-1))
        out.append(token)
        logits = model.head(model.span(model.embedding(torch.tensor([[token]])), cache))[:, -1]
    return out


def test_greedy_generation_equals_an_argmax_loop_and_streams_its_text(model, tokenizer):
    prompt = tokenizer.encode("The river ran past the mill")
    pieces = []
    result = generate(model, prompt, max_new_tokens=12, tokenizer=tokenizer, ignore_eos=True,
                      on_text=lambda row, text: pieces.append((row, text)), prefill_chunk=3)
    assert isinstance(result, GenerationResult)
    assert result.token_ids == [argmax_loop(model, prompt, 12)]
    assert result.texts[0] == tokenizer.decode(result.token_ids[0])
    assert "".join(text for _, text in pieces) == result.texts[0] and {row for row, _ in pieces} <= {0}
    assert result.finish_reasons == ["length"] and result.steps == 12 and result.prompt_tokens == len(prompt)
    assert 0 < result.time_to_first_token_s <= result.total_s and result.decode_s > 0
    assert result.decode_tokens_per_s == pytest.approx(11 / result.decode_s)


def test_batch_rows_are_independent_sequences(model, tokenizer):
    prompt = tokenizer.encode("Bread and salt")
    greedy = generate(model, prompt, max_new_tokens=6, batch=2, ignore_eos=True)
    assert greedy.token_ids[0] == greedy.token_ids[1] == argmax_loop(model, prompt, 6)
    sampled = generate(model, prompt, max_new_tokens=6, batch=2, ignore_eos=True,
                       sampling=SamplingParams(temperature=1.5, seed=7))
    again = generate(model, prompt, max_new_tokens=6, batch=2, ignore_eos=True,
                     sampling=SamplingParams(temperature=1.5, seed=7))
    assert sampled.token_ids == again.token_ids  # a seed reproduces a sampled generation
    assert sampled.token_ids[0] != sampled.token_ids[1]  # rows draw separately
    assert sampled.decode_tokens_per_s == pytest.approx(2 * 5 / sampled.decode_s)


def test_eos_and_stop_strings_end_a_sequence(model, tokenizer):
    prompt = tokenizer.encode("Once upon a time")
    free = generate(model, prompt, max_new_tokens=10, tokenizer=tokenizer, ignore_eos=True)
    ids = free.token_ids[0]
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # a token not generated before step k
    by_eos = generate(model, prompt, max_new_tokens=10, tokenizer=tokenizer, eos_ids=[ids[k]])
    assert by_eos.finish_reasons == ["eos"] and by_eos.token_ids[0] == ids[: k + 1]
    text = free.texts[0]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    by_stop = generate(model, prompt, max_new_tokens=10, tokenizer=tokenizer, ignore_eos=True, stop_strings=[stop])
    assert by_stop.finish_reasons == ["stop_string"]
    assert by_stop.texts[0] == text[: text.find(stop)]
    assert by_stop.token_ids[0] == ids[: len(by_stop.token_ids[0])]


def test_the_stop_flag_ends_generation_between_steps(model, tokenizer):
    stop = threading.Event()
    seen = []

    def on_text(row, text):
        seen.append(text)
        if len(seen) == 3:
            stop.set()

    result = generate(model, tokenizer.encode("The bell"), max_new_tokens=500, tokenizer=tokenizer,
                      ignore_eos=True, on_text=on_text, stop=stop)
    assert result.finish_reasons == ["stopped"]
    assert result.steps < 50


def test_generation_stops_at_the_end_of_the_context(tmp_path, tokenizer):
    path = make_demo_checkpoint(tmp_path / "short", max_position=24)
    m = open_model(path, max_length=24)
    try:
        prompt = tokenizer.encode("Hello")
        result = generate(m, prompt, max_new_tokens=100, ignore_eos=True)
        assert result.finish_reasons == ["length"] and len(prompt) + result.steps == 24
        with pytest.raises(InputError, match=r"has 24 tokens; the model's context is 24 tokens"):
            generate(m, list(range(3, 27)), max_new_tokens=1)
    finally:
        m.close()


def test_bad_arguments_are_input_errors(model):
    with pytest.raises(InputError, match="max_new_tokens"):
        generate(model, [1, 2], max_new_tokens=0)
    with pytest.raises(InputError, match="empty"):
        generate(model, [], max_new_tokens=3)
    with pytest.raises(InputError, match="same number of tokens"):
        generate(model, [[1, 2], [1, 2, 3]], max_new_tokens=3)


def test_repetition_penalty_changes_greedy_choices(model, tokenizer):
    prompt = tokenizer.encode("the the the the")
    plain = generate(model, prompt, max_new_tokens=20, ignore_eos=True)
    penalized = generate(model, prompt, max_new_tokens=20, ignore_eos=True,
                         sampling=SamplingParams(temperature=0, repetition_penalty=50.0))
    # with a huge penalty no token already in the prompt or the output comes back while fresh ones remain
    ids = penalized.token_ids[0]
    assert len(set(ids)) == len(ids) and not set(ids) & set(prompt)
    assert plain.token_ids != penalized.token_ids
