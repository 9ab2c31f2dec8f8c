"""A chat keeps its KV cache between turns (generation.PromptCache): greedy replies are token for token those of a
fresh prefill, a turn runs only its new tokens through the model, and re-rendered turns, a changed system prompt,
a conversation that outgrows the cache, a stopped or failed reply and a swarm session all stay exact."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from hivekeeper.core.runtime.chat_history import ChatHistory
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.placement import place_model
from hivekeeper.core.runtime.generation import PromptCache, conversation_cache, generate
from hivekeeper.core.runtime.model import ModelConfig
from hivekeeper.core.runtime.tokenizer import Tokenizer
from hivekeeper.planner.costmodel import Placement, Policy
from hivekeeper.planner.errors import InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TURNS = ("Hello there", "Tell me more about bees", "And then?")


def open_model(path, *, recompute: bool = False) -> OffloadedModel:
    """Weights half in RAM, half streamed from disk; the KV cache (or with recompute, the block inputs) half in RAM,
    half on disk: every tier a local cache can have on a CPU machine."""
    config = ModelConfig.from_folder(path)
    half = Placement(0, 0.5, 0.5)
    policy = Policy("fp32", half, half, Placement(0, 1, 0), prefetch_depth=1, kv_recompute=recompute)
    plan = place_model(config, policy, device="cpu", dtype=torch.float32, batch=1,
                       max_length=config.max_position_embeddings)
    return OffloadedModel(path, plan)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    m = open_model(tiny_checkpoint)
    yield m
    m.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return Tokenizer.from_folder(tiny_checkpoint)


class CountingRunner:
    """The model as generate() sees it, counting the tokens that go through its blocks."""

    def __init__(self, model):
        self.model, self.config, self.embedding, self.head = model, model.config, model.embedding, model.head
        self.span = self
        self.tokens = 0

    def allocate_cache(self, batch, max_length):
        return self.model.span.allocate_cache(batch, max_length)

    def __call__(self, hidden, cache):
        self.tokens += hidden.shape[1]
        return self.model.span(hidden, cache)


def chat_both_ways(model, tokenizer, history: ChatHistory, turns, cache: PromptCache, max_new_tokens=12,
                   max_prompt=None):
    """Each turn generated with a fresh cache and with the kept one; returns the results with the cache."""
    results = []
    for turn in turns:
        history.add_user(turn)
        prompt, _ = history.prompt_ids(tokenizer, max_prompt)
        fresh = generate(model, prompt, max_new_tokens=max_new_tokens, tokenizer=tokenizer)
        kept = generate(model, prompt, max_new_tokens=max_new_tokens, tokenizer=tokenizer, prompt_cache=cache)
        assert kept.token_ids == fresh.token_ids and kept.texts == fresh.texts
        assert fresh.cached_prompt_tokens == 0 and kept.prompt_tokens == fresh.prompt_tokens == len(prompt)
        history.add_assistant(kept.texts[0])
        results.append(kept)
    return results


@pytest.mark.parametrize("recompute", [False, True], ids=["kv", "recompute"])
def test_a_three_turn_chat_is_identical_with_and_without_the_cache(tiny_checkpoint, tokenizer, recompute):
    model = open_model(tiny_checkpoint, recompute=recompute)
    try:
        cache = conversation_cache(model.config.max_position_embeddings)
        history = ChatHistory(system_prompt="Be brief.")
        results = chat_both_ways(model, tokenizer, history, TURNS, cache)
        assert results[0].cached_prompt_tokens == 0
        for before, after in zip(results, results[1:]):
            # the earlier turns come from the cache: at least the previous prompt, never the whole new one
            assert before.prompt_tokens <= after.cached_prompt_tokens < after.prompt_tokens
            assert after.prefilled_tokens == after.prompt_tokens - after.cached_prompt_tokens
        assert cache.cache.length == len(cache.ids) and cache.capacity == model.config.max_position_embeddings
        cache.close()
        assert cache.cache is None and cache.ids == []
    finally:
        model.close()


def test_turn_two_runs_only_its_new_tokens_through_the_model(model, tokenizer):
    runner = CountingRunner(model)
    cache = PromptCache(256)
    first_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    first = generate(runner, first_prompt, max_new_tokens=10, tokenizer=tokenizer, prompt_cache=cache, ignore_eos=True)
    assert runner.tokens == len(first_prompt) + first.steps - 1  # the last sampled token is not run yet
    assert cache.ids == first_prompt + first.token_ids[0][:-1] and cache.cache.length == len(cache.ids)

    # the next prompt continues those very tokens: everything before it is reused
    new_turn = tokenizer.encode("\n<|user|>\nMore, please\n<|assistant|>\n")
    second_prompt = first_prompt + first.token_ids[0] + new_turn
    runner.tokens = 0
    second = generate(runner, second_prompt, max_new_tokens=10, tokenizer=tokenizer, prompt_cache=cache,
                      ignore_eos=True)
    reused = len(first_prompt) + first.steps - 1
    assert second.cached_prompt_tokens == reused and second.prefilled_tokens == len(second_prompt) - reused
    assert runner.tokens == second.prefilled_tokens + second.steps - 1
    assert second.as_dict()["cached_prompt_tokens"] == reused
    assert second.as_dict()["prefilled_tokens"] == second.prefilled_tokens
    fresh = generate(model, second_prompt, max_new_tokens=10, tokenizer=tokenizer, ignore_eos=True)
    assert second.token_ids == fresh.token_ids

    # the same prompt again: all but its last token is reused (its logits give the first new token)
    third = generate(runner, second_prompt, max_new_tokens=10, tokenizer=tokenizer, prompt_cache=cache,
                     ignore_eos=True)
    assert third.prefilled_tokens == 1 and third.token_ids == fresh.token_ids
    cache.close()


def test_re_rendered_turns_and_a_new_system_prompt_reuse_only_the_common_prefix(tiny_checkpoint, tmp_path, model):
    # a template that marks the latest user message: the next turn renders that message differently
    folder = tmp_path / "marking-template"
    shutil.copytree(tiny_checkpoint, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = config["chat_template"].replace(
        "message['content'] + eos_token",
        "message['content'] + (' (latest)' if loop.last and message['role'] == 'user' else '') + eos_token")
    config_file.write_text(json.dumps(config))
    tokenizer = Tokenizer.from_folder(folder)
    marked = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "Hi (latest)" in marked

    cache = conversation_cache(model.config.max_position_embeddings)
    history = ChatHistory(system_prompt="Be brief.")
    first, second = chat_both_ways(model, tokenizer, history, TURNS[:2], cache)
    last_prompt_len = second.prompt_tokens
    # turn 1's user message lost its mark: the cache is used up to it, not beyond
    system_and_header = len(tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}],
                                                          add_generation_prompt=False))
    assert system_and_header <= second.cached_prompt_tokens < first.prompt_tokens

    history.system_prompt = "Be verbose."  # the app lets the system prompt change mid-conversation
    (third,) = chat_both_ways(model, tokenizer, history, TURNS[2:], cache)
    assert 0 < third.cached_prompt_tokens < system_and_header and third.prompt_tokens > last_prompt_len
    cache.close()


def test_a_conversation_that_outgrows_the_cache_starts_over_without_an_error(model, tokenizer):
    cache = PromptCache(96)
    history = ChatHistory(system_prompt="Be brief.")
    # as the chat command does: the oldest turns are left out so that prompt and reply fit in the cache
    results = chat_both_ways(model, tokenizer, history, [f"Question number {i}" for i in range(5)], cache,
                             max_new_tokens=16, max_prompt=96 - 16)
    assert history.prompt_ids(tokenizer, 96 - 16)[1] > 0  # turns were dropped
    assert all(r.prompt_tokens + 16 <= 96 for r in results)
    assert any(r.cached_prompt_tokens > 0 for r in results[1:])

    # a call that needs more than the cache holds runs without it (as it would with no cache) and empties it
    long_prompt = history.prompt_ids(tokenizer)[0]
    assert len(long_prompt) + 16 > 96
    alone = generate(model, long_prompt, max_new_tokens=16, tokenizer=tokenizer, prompt_cache=cache)
    fresh = generate(model, long_prompt, max_new_tokens=16, tokenizer=tokenizer)
    assert alone.token_ids == fresh.token_ids and alone.cached_prompt_tokens == 0
    assert cache.cache is None and cache.ids == []
    short = history.prompt_ids(tokenizer, 96 - 16)[0]
    again = generate(model, short, max_new_tokens=16, tokenizer=tokenizer, prompt_cache=cache)
    assert again.cached_prompt_tokens == 0 and cache.cache.length == len(cache.ids)
    cache.close()


def test_a_cache_too_small_for_a_turn_and_a_stale_one_are_allocated_again(model, tokenizer):
    cache = PromptCache(2048, initial_length=100)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])  # ~10 tokens
    generate(model, prompt, max_new_tokens=20, prompt_cache=cache, ignore_eos=True)
    assert cache.capacity == 100 and len(cache.ids) == len(prompt) + 19
    longer = cache.ids + [7] * 30
    result = generate(model, longer, max_new_tokens=20, prompt_cache=cache, ignore_eos=True)
    assert result.cached_prompt_tokens == len(longer) - 30 and cache.capacity == 100
    longest = cache.ids + [9] * 90  # more than it holds: a cache of exactly what it needs, prefilled from the start
    result = generate(model, longest, max_new_tokens=20, prompt_cache=cache, ignore_eos=True)
    assert cache.capacity == len(longest) + 20 and result.cached_prompt_tokens == 0
    fresh = generate(model, longest, max_new_tokens=20, ignore_eos=True)
    assert result.token_ids == fresh.token_ids

    stale = PromptCache(2048, max_idle_s=0.0)
    generate(model, prompt, max_new_tokens=4, prompt_cache=stale)
    again = generate(model, prompt + [5, 6], max_new_tokens=4, prompt_cache=stale)
    assert again.cached_prompt_tokens == 0  # idle too long (a swarm server would have ended the session)
    for c in (cache, stale):
        c.close()


def test_a_stopped_or_failed_reply_leaves_the_cache_consistent(model, tokenizer):
    import threading

    cache = conversation_cache(model.config.max_position_embeddings)
    history = ChatHistory()
    history.add_user("Tell me a story")
    prompt, _ = history.prompt_ids(tokenizer)
    stop = threading.Event()
    stopped = generate(model, prompt, max_new_tokens=200, tokenizer=tokenizer, prompt_cache=cache, stop=stop,
                       on_text=lambda row, text: stop.set(), ignore_eos=True)
    assert stopped.finish_reasons == ["stopped"]
    assert cache.cache.length == len(cache.ids) == len(prompt) + stopped.steps - 1
    history.add_assistant(stopped.texts[0])
    (after,) = chat_both_ways(model, tokenizer, history, ["Go on"], cache)
    assert after.cached_prompt_tokens >= len(prompt)

    def fail(row, text):
        raise RuntimeError("the window closed")

    with pytest.raises(RuntimeError, match="window closed"):
        generate(model, prompt, max_new_tokens=20, tokenizer=tokenizer, prompt_cache=cache, on_text=fail)
    assert cache.cache is None and cache.ids == []  # unknown state: dropped
    result = generate(model, prompt, max_new_tokens=4, tokenizer=tokenizer, prompt_cache=cache)
    assert result.cached_prompt_tokens == 0

    with pytest.raises(InputError, match="one sequence"):
        generate(model, [[1, 2], [3, 4]], max_new_tokens=2, prompt_cache=cache)
    with pytest.raises(InputError, match="max_length"):
        PromptCache(1)
    cache.close()


STATS = re.compile(r"first token [\d.]+ s(?:, stopped)?\] "
                   r"\(prompt (\d+) tokens: (\d+) prefilled, (\d+) from the cache\)")


def test_the_chat_command_reports_prefilled_and_cached_prompt_tokens(tiny_checkpoint):
    import os
    import subprocess
    import sys

    typed = "Hello there\nAnd more\n/reset\nFresh start\n"  # then end of input: the chat quits
    done = subprocess.run([sys.executable, "-m", "hivekeeper.core.cli.main", "chat", "--model", str(tiny_checkpoint),
                           "--max-new-tokens", "6", "--system", "Be brief.", "--temperature", "0"],
                          input=typed, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert "conversation cleared" in done.stdout
    counts = [tuple(int(x) for x in m) for m in STATS.findall(done.stdout)]
    assert len(counts) == 3, done.stdout
    (first_prompt, first_prefilled, first_cached), second, after_reset = counts
    assert first_cached == 0 and first_prefilled == first_prompt
    assert second[2] >= first_prompt and second[1] == second[0] - second[2]
    assert after_reset[2] == 0 and after_reset[1] == after_reset[0]


@pytest.mark.slow
def test_a_swarm_chat_keeps_its_session_between_turns(tiny_checkpoint, tokenizer, tmp_path, model):
    from hivekeeper.core.swarm.client.inference import SwarmModel
    from hivekeeper.core.swarm.local import LocalSwarm

    (tmp_path / "logs").mkdir()
    with LocalSwarm(tiny_checkpoint, extra_args=("--torch-threads", "1"), log_dir=tmp_path / "logs",
                    env={"XDG_CACHE_HOME": str(tmp_path / "cache")}) as swarm:
        swarm.start("--num-blocks", "2")
        with SwarmModel(str(tiny_checkpoint), initial_peers=swarm.initial_peers) as remote:
            cache = conversation_cache(remote.config.max_position_embeddings, swarm=True)
            try:
                history = ChatHistory(system_prompt="Be brief.")
                results = chat_both_ways(remote, tokenizer, history, TURNS[:2], cache, max_new_tokens=6)
                session = cache.cache
                assert results[1].cached_prompt_tokens >= results[0].prompt_tokens
                assert session.length == len(cache.ids)
                assert cache.capacity == 2048  # the session reserved for the conversation
                # the swarm computes what the local engine does
                prompt = history.prompt_ids(tokenizer)[0]
                local = generate(model, prompt, max_new_tokens=6, tokenizer=tokenizer)
                assert generate(remote, prompt, max_new_tokens=6, prompt_cache=cache).token_ids == local.token_ids
                assert cache.cache is session  # the same server session all along
            finally:
                cache.close()
