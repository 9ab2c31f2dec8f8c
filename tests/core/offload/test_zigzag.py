"""The planner's throughput policy as the engine runs it: a batch split into micro-batches, every block's weights
streamed from disk, the zig-zag block schedule (each block loaded once, every micro-batch run through it, then the
next block, the next ones prefetched meanwhile).

The greedy text of such a run must equal each prompt's own resident run (load_span, one KVCache, batch 1), and the
real block reader must have read each block's weights once per step for the whole batch, not once per micro-batch.
"""

from __future__ import annotations

import pytest
import torch

from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.placement import block_bytes, place_model
from hivekeeper.core.runtime.checkpoint import load_embedding, load_head, load_span
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.core.runtime.generation import generate
from hivekeeper.core.runtime.model import KVCache, ModelConfig
from hivekeeper.planner.costmodel import CPU_PART_TOKENS, Placement, Policy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 17, 42, 99, 7, 250], [1, 300, 5, 5, 81, 12], [1, 2, 3, 4, 5, 6], [1, 200, 150, 100, 50, 25]]
NEW_TOKENS = 6
MAX_LENGTH = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_demo_checkpoint(tmp_path_factory.mktemp("zigzag") / "m", layers=4, shard_size_mb=0.3, seed=11)


def throughput_policy(depth: int, micro: int, count: int) -> Policy:
    """Every block on disk, the KV cache half in RAM and half in memory-mapped files, `count` micro-batches."""
    return Policy("fp32", Placement(0, 0, 1), Placement(0, 0.5, 0.5), Placement(0, 1, 0), micro_batch_size=micro,
                  num_micro_batches=count, prefetch_depth=depth)


@torch.inference_mode()
def resident_greedy(path, prompt: list[int]) -> list[int]:
    """One prompt alone, every block resident, argmax: the text the batched offloaded run must give for it."""
    config = ModelConfig.from_folder(path)
    span, embedding, head = load_span(path, 0, config.num_layers), load_embedding(path), load_head(path)
    cache = KVCache.allocate(config, config.num_layers, 1, MAX_LENGTH)
    logits = head(span(embedding(torch.tensor([prompt])), cache))[:, -1]
    tokens = []
    for _ in range(NEW_TOKENS):
        tokens.append(int(logits.argmax(-1)))
        logits = head(span(embedding(torch.tensor([[tokens[-1]]])), cache))[:, -1]
    return tokens


@pytest.mark.parametrize("depth, micro, count", [(2, 1, 4), (1, 2, 2), (0, 3, 2)])
def test_batched_zigzag_run_gives_each_prompts_resident_text_and_reads_each_block_once_per_step(
        checkpoint, depth, micro, count):
    config = ModelConfig.from_folder(checkpoint)
    plan = place_model(config, throughput_policy(depth, micro, count), device="cpu", dtype=torch.float32,
                       batch=len(PROMPTS), max_length=MAX_LENGTH)
    assert plan.weight_tiers == ("disk",) * 4 and set(plan.cache_tiers) == {"cpu", "disk"}
    assert (plan.micro_batch_size, plan.num_micro_batches, plan.prefetch_depth) == (micro, count, depth)
    with OffloadedModel(checkpoint, plan) as model:
        result = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        reader = model.reader
    assert result.token_ids == [resident_greedy(checkpoint, prompt) for prompt in PROMPTS]
    # one prefill step and NEW_TOKENS - 1 decode steps; each read every block once for all micro-batches. The
    # prefetch crosses into the next step, so the first `depth + 1` blocks may be read once more (then dropped).
    steps = NEW_TOKENS
    slots = min(depth + 1, config.num_layers)
    reads = [reader.reads[layer] for layer in range(config.num_layers)]
    assert all(steps <= n <= steps + 1 for n in reads), reads
    assert sum(reads) <= steps * config.num_layers + slots
    assert reader.bytes_read == sum(reads) * block_bytes(config, torch.float32)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_the_reader_thread_keeps_the_policys_prefetch_depth_of_blocks_in_flight_within_its_slots(checkpoint, depth):
    """The mechanism, not its speed: whenever a streamed block is handed to compute, the reads of the next `depth`
    blocks (in schedule order, across the step boundary) are already issued to the reader thread; every read runs
    on that thread, into one of depth + 1 slots (what the plan counts against the RAM budget); same tokens."""
    import threading

    config = ModelConfig.from_folder(checkpoint)
    plan = place_model(config, throughput_policy(depth, 2, 2), device="cpu", dtype=torch.float32,
                       batch=len(PROMPTS), max_length=MAX_LENGTH)
    layers = config.num_layers
    assert plan.ram_breakdown["stream_buffers"] == (depth + 1) * block_bytes(config, torch.float32)
    with OffloadedModel(checkpoint, plan) as model:
        streamer, reader = model.streamer, model.reader
        in_flight, read_threads, blocks_read_into = [], set(), set()
        acquire, fill = streamer.acquire, reader.fill

        def acquire_and_look_ahead(layer):
            block = acquire(layer)
            in_flight.append((layer, [pending_layer for pending_layer, _, _ in streamer.pending]))
            return block

        def fill_and_note_where(block, layer):
            read_threads.add(threading.current_thread().name)
            blocks_read_into.add(id(block))
            return fill(block, layer)

        streamer.acquire, reader.fill = acquire_and_look_ahead, fill_and_note_where
        result = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert result.token_ids == [resident_greedy(checkpoint, prompt) for prompt in PROMPTS]
    assert len(in_flight) == NEW_TOKENS * layers
    for layer, pending in in_flight:
        assert pending == [(layer + k) % layers for k in range(1, depth + 1)], (layer, pending)
    assert len(blocks_read_into) == depth + 1
    assert read_threads and all(name.startswith("hivekeeper-reader") for name in read_threads), read_threads


def stored_rows(model, prompts: list[list[int]], max_length: int) -> tuple[list, list]:
    """Greedy-generate `prompts`; (prefill, decode): the (start, stop) rows of every block's K/V store, as the
    cache's own store method is called."""
    stored = []
    original_allocate = model.span.allocate_cache

    def allocate_and_watch(batch, length):
        cache = original_allocate(batch, length)
        store = cache.store

        def store_and_note(index, position, tokens, rows=slice(None)):
            stored.append((tokens, (rows.start, rows.stop)))
            return store(index, position, tokens, rows)

        cache.store = store_and_note
        return cache

    model.span.allocate_cache = allocate_and_watch
    result = generate(model, prompts, max_new_tokens=max_length - len(prompts[0]), ignore_eos=True)
    return result, [rows for tokens, rows in stored if tokens > 1], [rows for tokens, rows in stored if tokens == 1]


def test_on_a_cpu_decode_runs_the_whole_batch_and_prefill_merges_micro_batches_up_to_a_part_size(checkpoint):
    """On a CPU the placement counts a step's activations by part (workspace_bytes), and a CPU multiplies
    many rows far better than a few: a decode step runs the batch as one, a prefill chunk merges the plan's
    micro-batches until a part holds CPU_PART_TOKENS token rows (same tokens). A prompt whose attention scores would
    not fit that workspace (300 tokens: 4 heads x 300^2 fp32 scores a row against ~1.2 MB) keeps the plan's."""
    config = ModelConfig.from_folder(checkpoint)
    plan = place_model(config, throughput_policy(1, 1, 4), device="cpu", dtype=torch.float32,
                       batch=len(PROMPTS), max_length=MAX_LENGTH)
    with OffloadedModel(checkpoint, plan) as model:
        result, prefill, decode = stored_rows(model, PROMPTS, len(PROMPTS[0]) + NEW_TOKENS)
    assert result.token_ids == [resident_greedy(checkpoint, prompt) for prompt in PROMPTS]
    assert prefill == [(0, len(PROMPTS))] * config.num_layers  # 4 x 6 token rows: one part
    assert decode == [(0, len(PROMPTS))] * config.num_layers * (NEW_TOKENS - 1)

    def prompts(count: int, length: int) -> list[list[int]]:
        return [[1] + [(p * 31 + 7 * i) % 500 + 2 for i in range(length - 1)] for p in range(count)]

    assert CPU_PART_TOKENS == 1024  # 200-token prompts: parts of 6 rows (1200 token rows), then the rest
    plan = place_model(config, throughput_policy(1, 1, 8), device="cpu", dtype=torch.float32, batch=8,
                       max_length=202)
    with OffloadedModel(checkpoint, plan) as model:
        _, prefill, decode = stored_rows(model, prompts(8, 200), 202)
    assert prefill == [(0, 6), (6, 8)] * config.num_layers and decode == [(0, 8)] * config.num_layers

    plan = place_model(config, throughput_policy(1, 1, 4), device="cpu", dtype=torch.float32,
                       batch=len(PROMPTS), max_length=302)
    with OffloadedModel(checkpoint, plan) as model:
        _, prefill, decode = stored_rows(model, prompts(len(PROMPTS), 300), 302)
    # two prefill chunks (256 and 44 tokens; the second's scores reach back over 300 keys), each by micro-batch
    assert prefill == [(i, i + 1) for i in range(len(PROMPTS))] * config.num_layers * 2
    assert decode == [(0, len(PROMPTS))] * config.num_layers  # one decode step: its scores are one query a row
