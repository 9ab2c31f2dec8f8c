"""The API's engines on a tiny checkpoint opened as `hivekeeper api` opens it: requests held back and released
together are decoded in one batch, each giving the greedy text it gives alone (generation.generate); a cancelled
request leaves the batch and frees its cache; a failing request does not stop the others; a cache that fills grows;
the serial engine gives the same texts."""

from __future__ import annotations

import threading

import pytest

from hivekeeper.core.api.service import engine_for
from hivekeeper.core.cli.generate import open_runner, resolve_model
from hivekeeper.core.cli.main import build_parser
from hivekeeper.core.runtime import continuous
from hivekeeper.core.runtime.continuous import ContinuousBatcher, Request, SerialEngine
from hivekeeper.core.runtime.generation import generate
from hivekeeper.core.runtime.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = ["hello there", "the cat sat on the mat and", "one two", "a b c d e f g h i j"]
NEW_TOKENS = 12
DEADLINE_S = 120
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", autouse=True)
def torch_decode_only():
    """Alone and in a batch, every step runs torch's code (the native and numpy decode paths off): the batch's
    equality with each sequence alone is then a matter of float rounding between two torch matmul shapes, not of two
    different kernels, whose greedy choices can part at a near-tie of a random-weight model (a CI run saw it)."""
    from hivekeeper.core.runtime.kernels import cpu_decode, native_kernels

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_kernels, "ENABLED", False)
        patch.setattr(cpu_decode, "ENABLED", False)
        yield


@pytest.fixture(scope="module")
def runner(tiny_checkpoint):
    args = build_parser().parse_args(["api", "--model", str(tiny_checkpoint)])
    path, tokenizer, config = resolve_model(args)
    opened = open_runner(args, path, tokenizer, config, batch=1, prompt_len=64, max_length=128, ram_budget=None)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def alone(runner):
    """Each prompt's greedy text from generation.generate, one at a time."""
    return [generate(runner.model, runner.tokenizer.encode(p), max_new_tokens=NEW_TOKENS, tokenizer=runner.tokenizer,
                     ignore_eos=True).texts[0] for p in PROMPTS]


class Outcomes:
    """Requests whose on_done records what they ended with."""

    def __init__(self, runner):
        self.runner, self.done, self.finished = runner, {}, threading.Event()
        self.expected = 0

    def request(self, key, prompt: str, max_new: int = NEW_TOKENS, ids: list[int] | None = None) -> Request:
        self.expected += 1

        def on_done(outcome):
            self.done[key] = outcome
            if len(self.done) == self.expected:
                self.finished.set()

        ids = ids if ids is not None else self.runner.tokenizer.encode(prompt)
        return Request(ids, max_new, GREEDY, on_done=on_done)

    def wait(self) -> dict:
        assert self.finished.wait(DEADLINE_S), f"only {sorted(self.done)} finished"
        return self.done


def no_eos(engine, runner):
    """The tiny model's EOS would end rows at random points: these tests compare fixed-length texts."""
    runner.model.config.eos_token_ids = ()
    runner.tokenizer.eos_token_ids = ()
    return engine


@pytest.fixture
def batcher(runner):
    saved = runner.model.config.eos_token_ids, getattr(runner.tokenizer, "eos_token_ids", ())
    engine = no_eos(engine_for(runner.model, runner.tokenizer, 8), runner)
    yield engine
    engine.close()
    runner.model.config.eos_token_ids, runner.tokenizer.eos_token_ids = saved


def test_the_api_engine_of_a_model_held_in_ram_is_the_batcher(batcher, runner):
    assert isinstance(batcher, ContinuousBatcher)
    single = engine_for(runner.model, runner.tokenizer, 1)  # --max-batch 1
    try:
        assert isinstance(single, SerialEngine)
    finally:
        single.close()


def test_requests_released_together_are_decoded_together_with_their_own_text(batcher, runner, alone):
    outcomes = Outcomes(runner)
    with batcher.hold():
        for i, prompt in enumerate(PROMPTS):
            batcher.submit(outcomes.request(i, prompt))
        assert batcher.waiting == len(PROMPTS)
    done = outcomes.wait()
    assert batcher.stats.largest_batch == len(PROMPTS)
    # the prompts of 12 tokens prefilled as one padded group; those of 6 and 4 alone (SHORT_PROMPT_TOKENS)
    assert (batcher.stats.prefill_groups, batcher.stats.largest_prefill) == (3, 2)
    assert [done[i].text for i in range(len(PROMPTS))] == alone
    assert all(done[i].finish_reason == "length" and len(done[i].token_ids) == NEW_TOKENS for i in done)
    assert batcher.active == 0


def test_a_cancelled_request_leaves_the_batch_and_the_others_go_on(batcher, runner, alone):
    outcomes = Outcomes(runner)
    long = outcomes.request("long", PROMPTS[1], max_new=60)
    pieces = []

    def leave_after_three(text: str) -> None:  # the client leaves while the batch runs
        pieces.append(text)
        if len(pieces) == 3:
            long.cancelled.set()

    long.on_text = leave_after_three
    with batcher.hold():
        batcher.submit(long)
        batcher.submit(outcomes.request("short", PROMPTS[0]))
    done = outcomes.wait()
    assert done["long"].finish_reason == "stopped" and len(done["long"].token_ids) == 3
    assert done["short"].text == alone[0]
    assert batcher.active == 0


def test_a_request_cancelled_before_it_starts_ends_with_its_first_token(batcher, runner):
    outcomes = Outcomes(runner)
    with batcher.hold():
        request = outcomes.request("gone", PROMPTS[0])
        batcher.submit(request)
        request.cancelled.set()
    done = outcomes.wait()
    assert done["gone"].finish_reason == "stopped" and len(done["gone"].token_ids) == 1
    assert batcher.active == 0


def test_running_streams_go_on_while_a_long_prompt_is_prefilled_in_chunks(batcher, runner, monkeypatch):
    monkeypatch.setattr(continuous, "PREFILL_CHUNK", 8)
    outcomes = Outcomes(runner)
    running = outcomes.request("running", PROMPTS[0], max_new=60)
    pieces, seen_at = [], {}
    started = threading.Event()

    def on_text(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 2:
            started.set()

    running.on_text = on_text
    batcher.submit(running)
    assert started.wait(DEADLINE_S)
    long = outcomes.request("long", "", max_new=2, ids=list(range(5, 45)))  # 40 tokens: 5 chunks of 8
    long.on_text = lambda text: seen_at.setdefault("first", len(pieces))
    seen_at["submitted"] = len(pieces)
    batcher.submit(long)
    done = outcomes.wait()
    assert len(done["long"].token_ids) == 2 and len(done["running"].token_ids) == 60
    # a decode step of the running stream after each of the first four chunks, before the long one's first token
    assert seen_at["first"] - seen_at["submitted"] >= 4


def test_prompts_that_begin_alike_prefill_their_beginning_once_and_keep_their_own_text(batcher, runner):
    beginning = list(range(5, 17))  # 12 tokens, as a chat template's system prompt
    prompts = [beginning + [20, 21], beginning + [30, 31, 32], beginning + [40]]
    alone = [generate(runner.model, ids, max_new_tokens=NEW_TOKENS, tokenizer=runner.tokenizer,
                      ignore_eos=True).texts[0] for ids in prompts]
    outcomes = Outcomes(runner)
    with batcher.hold():
        for i, ids in enumerate(prompts):
            batcher.submit(outcomes.request(i, "", ids=ids))
    done = outcomes.wait()
    assert [done[i].text for i in range(len(prompts))] == alone
    assert batcher.stats.largest_prefill == 3 and batcher.stats.shared_tokens == 2 * len(beginning)


def test_a_failing_request_fails_alone(batcher, runner, alone):
    outcomes = Outcomes(runner)
    vocab = runner.model.config.vocab_size
    with batcher.hold():
        batcher.submit(outcomes.request("bad", "", ids=[vocab + 5]))  # no such token: the embedding raises
        batcher.submit(outcomes.request("good", PROMPTS[2]))
    done = outcomes.wait()
    assert isinstance(done["bad"], Exception)
    assert done["good"].text == alone[2]


def test_a_cache_that_fills_grows_and_keeps_what_it_holds(batcher, runner, alone, monkeypatch):
    monkeypatch.setattr(continuous, "FIRST_CACHE_TOKENS", 2)
    outcomes = Outcomes(runner)
    with batcher.hold():
        for i in (0, 3):
            batcher.submit(outcomes.request(i, PROMPTS[i]))
    done = outcomes.wait()
    assert done[0].text == alone[0] and done[3].text == alone[3]


def test_uninitialised_pool_memory_holding_nan_does_not_reach_a_short_row(batcher, runner, alone, monkeypatch):
    """The pool comes from KVCache.allocate (torch.empty): here its memory holds NaN, as reused memory can; a short
    row in a batch with a long one attends over the long one's length, masked, and must still give its own text."""
    from hivekeeper.core.runtime.model import KVCache

    allocate = KVCache.allocate.__func__

    def poisoned(cls, *args, **kwargs):
        cache = allocate(cls, *args, **kwargs)
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
        return cache

    monkeypatch.setattr(KVCache, "allocate", classmethod(poisoned))
    outcomes = Outcomes(runner)
    with batcher.hold():
        for i in (3, 0):  # the long prompt first: the short one stands at a lower position in every step
            batcher.submit(outcomes.request(i, PROMPTS[i]))
    done = outcomes.wait()
    assert done[0].text == alone[0] and done[3].text == alone[3]


def test_the_serial_engine_gives_the_same_texts(runner, alone):
    saved = runner.model.config.eos_token_ids, getattr(runner.tokenizer, "eos_token_ids", ())
    engine = no_eos(SerialEngine(runner.model, runner.tokenizer), runner)
    try:
        outcomes = Outcomes(runner)
        for i, prompt in enumerate(PROMPTS):
            engine.submit(outcomes.request(i, prompt))
        done = outcomes.wait()
        assert [done[i].text for i in range(len(PROMPTS))] == alone
        assert engine.stats.largest_batch == 1
    finally:
        engine.close()
        runner.model.config.eos_token_ids, runner.tokenizer.eos_token_ids = saved


def test_closing_with_rows_running_ends_each_as_stopped(runner):
    """Session 23: closed with two or more rows decoding, the engine's thread moved pool rows outside inference mode
    ("Inplace update to inference tensor outside InferenceMode") and the requests never ended. Each ends "stopped",
    with the text it had. The first request's third piece of text holds the engine's thread while the test closes it."""
    engine = no_eos(engine_for(runner.model, runner.tokenizer, 8), runner)
    outcomes = Outcomes(runner)
    requests = [outcomes.request(i, prompt, max_new=60) for i, prompt in enumerate(PROMPTS)]
    pieces, inside, resume = [], threading.Event(), threading.Event()

    def hold_at_the_third(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 3:
            inside.set()
            resume.wait(DEADLINE_S)

    requests[0].on_text = hold_at_the_third
    try:
        with engine.hold():
            for request in requests:
                engine.submit(request)
        assert inside.wait(DEADLINE_S)
        assert engine.active >= 2
        engine.close(timeout=0)  # closed while a step is under way
    finally:
        resume.set()
        engine.close()
    done = outcomes.wait()
    assert {outcome.finish_reason for outcome in done.values()} == {"stopped"}
    assert 3 <= len(done[0].token_ids) < 60
