"""The continuous batcher on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF, packed blocks) opened as
`hivekeeper api` opens it, with the native kernels on: requests arriving one after another while the others decode
join the running batch, whose steps are one native call for rows at different positions (hk_span_decode_rows), and
each gives the greedy text `generation.generate` gives it alone, token for token (the packed kernels give a row the
same bits in any batch). A group's padded prefill is not checked here: its products run in matrices of other
sizes, which numpy's BLAS rounds differently (see continuous._Filling); test_continuous checks it on fp32 weights."""

from __future__ import annotations

import threading

import pytest

from hivekeeper.core.api.service import engine_for
from hivekeeper.core.cli.generate import open_runner, resolve_model
from hivekeeper.core.cli.main import build_parser
from hivekeeper.core.runtime import ragged
from hivekeeper.core.runtime.continuous import ContinuousBatcher, Request
from hivekeeper.core.runtime.default_model import INSTALL_HINT, default_model_file
from hivekeeper.core.runtime.generation import generate
from hivekeeper.core.runtime.kernels import native_kernels
from hivekeeper.core.runtime.sampling import SamplingParams

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(default_model_file() is None,
                                 reason=f"the default model is not installed ({INSTALL_HINT})")]

PROMPTS = ["Water boils at a temperature of one hundred degrees Celsius, and", "The capital of France is",
           "List three colours of the rainbow, one per line, starting with red:", "Bees"]
NEW_TOKENS = 8
DEADLINE_S = 240
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runner():
    args = build_parser().parse_args(["api"])
    path, tokenizer, config = resolve_model(args)
    opened = open_runner(args, path, tokenizer, config, batch=1, prompt_len=64, max_length=128, ram_budget=None)
    yield opened
    opened.close()


def stop_strings(tokenizer) -> tuple[str, ...]:
    return tuple(getattr(tokenizer, "stop_strings", ()))


def test_requests_joining_a_running_batch_decode_natively_with_their_own_greedy_text(runner, monkeypatch):
    if native_kernels.library() is None:
        pytest.skip(f"the native kernels are not built here: {native_kernels.status()}")
    tokenizer = runner.tokenizer
    ids = [tokenizer.encode(prompt) for prompt in PROMPTS]
    assert len({len(i) for i in ids}) == len(PROMPTS)  # every row stands at its own position
    alone = [generate(runner.model, i, max_new_tokens=NEW_TOKENS, tokenizer=tokenizer,
                      stop_strings=stop_strings(tokenizer), ignore_eos=True).texts[0] for i in ids]
    native_steps = []
    native_rows = ragged._native_rows
    monkeypatch.setattr(ragged, "_native_rows", lambda *a: native_steps.append(native_rows(*a)) or native_steps[-1])
    monkeypatch.setattr(runner.model.config, "eos_token_ids", ())  # every reply runs NEW_TOKENS tokens
    engine = engine_for(runner.model, tokenizer, 8)
    try:
        assert isinstance(engine, ContinuousBatcher)
        done, finished = {}, threading.Event()
        started = [threading.Event() for _ in PROMPTS]

        def request(key: int) -> Request:
            def record(outcome):
                done[key] = outcome
                if len(done) == len(PROMPTS):
                    finished.set()
            return Request(ids[key], NEW_TOKENS, GREEDY, on_text=lambda text: started[key].set(), on_done=record)

        for key in range(len(PROMPTS)):  # each arrives once the one before has its first token
            engine.submit(request(key))
            assert started[key].wait(DEADLINE_S)
        assert finished.wait(DEADLINE_S), f"only {sorted(done)} finished"
        assert [done[key].text for key in range(len(PROMPTS))] == alone
        assert engine.stats.largest_batch >= 3 and engine.stats.prefill_groups == len(PROMPTS)
        assert native_steps and all(out is not None for out in native_steps)
    finally:
        engine.close()
