"""The planner counts a CPU step's activations as the engine holds them (issue 22): the batch's hidden states, one
prefill part's workspace (whole micro-batches up to CPU_PART_TOKENS token rows, as core/offload's _step_rows runs
them), and the whole batch's logits; on a CPU the hidden states are in the one memory whatever the activations'
placement says."""

from __future__ import annotations

import numpy as np

from hivekeeper.planner.costmodel import (CPU_PART_TOKENS, LOGIT_COPIES, Workload, cpu_part_sequences, fixed_memory,
                                          format_traits, machine_view, model_numbers)
from hivekeeper.planner.efficiency import default_efficiency
from hivekeeper.planner.hardware import ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.models import ModelSpec

MODEL = ModelSpec(name="demo-350mb", family="llama", num_layers=12, hidden_size=768, intermediate_size=2048,
                  num_heads=12, num_kv_heads=4, head_dim=64, vocab_size=8192, tie_word_embeddings=False,
                  max_position_embeddings=2048)
CPU = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=4 * 10**9, memory_bandwidth=20e9,
                    flops={"fp32": 2e11, "bf16": 4e11}, power_watts=50.0, cores=2)
HARDWARE = HardwareSpec(id="test-cpu", gpus=(), cpu=CPU,
                        disk=DiskSpec(capacity_bytes=10**12, read_bandwidth=1e9, write_bandwidth=1e9),
                        network=NetworkSpec(upload_bps=1e8, download_bps=1e8, rtt_s=0.01))
PROMPT = 16


def acc_bytes(**columns: float) -> float:
    """The fixed memory of one bf16 candidate (KV cache in RAM: its size follows the batch, not the micro-batch)
    with these grid columns."""
    view = machine_view(HARDWARE)
    cols = {"fmt": 0, "wa": 0.0, "wh": 0.0, "wd": 1.0, "ca": 1.0, "ch": 0.0, "cd": 0.0, "ah": 0.0, "b": 1, "n": 1,
            "rec": 0, "d": 0, "cattn": 0}
    cols.update(columns)
    cols = {key: np.array([value], dtype=int if key in ("fmt", "b", "n", "rec", "d", "cattn") else float)
            for key, value in cols.items()}
    mem = fixed_memory(model_numbers(MODEL), view, default_efficiency(HARDWARE), Workload(PROMPT, 8),
                       [format_traits(view, "bf16")], cols)
    return float(mem["acc"][0])


def test_a_prefill_part_is_whole_micro_batches_of_at_least_the_part_size_and_at_most_the_batch():
    assert CPU_PART_TOKENS == 1024
    assert cpu_part_sequences(512, 32, 16) == 64  # 2 micro-batches of 32 x 16 tokens: 1024 rows
    assert cpu_part_sequences(512, 24, 16) == 72  # 3 micro-batches: the first count at or above 1024 rows
    assert cpu_part_sequences(40, 32, 16) == 40  # never more than the batch
    assert cpu_part_sequences(8, 1, 200) == 6  # 6 x 200 = 1200 rows
    assert list(cpu_part_sequences(np.array([128, 128]), np.array([8, 256]), 16)) == [64, 128]


def test_micro_batches_the_engine_merges_into_the_same_parts_need_the_same_memory():
    """Batch 128 as 16 micro-batches of 8 or as 2 of 64: on a CPU both run as 2 parts of 64 prompts of 16 tokens."""
    assert acc_bytes(b=8, n=16) == acc_bytes(b=64, n=2)
    assert acc_bytes(b=8, n=16) < acc_bytes(b=128, n=1)  # one part of 128: twice the workspace


def test_a_larger_batch_adds_its_hidden_states_and_logits_not_its_whole_workspace():
    """Batch 256 against 128, both in parts of 64: only the hidden states of the other parts, the logits and the
    disk-tier block's cache mapped in for its turn (the whole batch's) grow."""
    numbers = model_numbers(MODEL)
    on_disk = {"ca": 0.0, "cd": 1.0}  # the KV cache on disk: one block's is in RAM during its turn
    grown = acc_bytes(b=64, n=4, **on_disk) - acc_bytes(b=64, n=2, **on_disk)
    hidden_and_logits = 128 * (PROMPT * numbers.hidden * 2.0 + LOGIT_COPIES * numbers.vocab * 4.0)
    cache_in_turn = 128 * (PROMPT + 8) * 2 * numbers.kv_dim * 2.0
    assert grown == hidden_and_logits + cache_in_turn
    assert grown < 128 * PROMPT * numbers.workspace_values_per_token * 2.0  # the whole batch's workspace would


def test_on_a_cpu_hidden_states_placed_on_the_host_are_still_counted():
    assert acc_bytes(b=64, n=2, ah=1.0) == acc_bytes(b=64, n=2, ah=0.0)


def test_recompute_runs_the_plans_micro_batches_so_its_part_is_one_micro_batch():
    assert acc_bytes(b=8, n=16, rec=1) < acc_bytes(b=64, n=2, rec=1)
