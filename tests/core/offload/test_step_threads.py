"""Torch's threads per step of the offloaded block loop. Under the runtime's thread layout (use_physical_cores:
torch on one thread, fp32 products on numpy's BLAS or the native pool) a 16-bit plan's products are torch's own, so a
prefill chunk runs on every physical core and a decode step on one (the reader thread needs the other core). An fp32
plan, or a caller's own layout (OMP_NUM_THREADS, or no runtime layout at all), keeps torch's threads as they are.
Each case gives the same greedy tokens, and torch's threads are restored after every step.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from hivekeeper.core.offload import offloaded_model
from hivekeeper.core.offload.offloaded_model import OffloadedModel
from hivekeeper.core.offload.placement import place_model
from hivekeeper.core.runtime.generation import generate
from hivekeeper.core.runtime.kernels.cpu_threads import physical_cores
from hivekeeper.core.runtime.model import Block, ModelConfig
from hivekeeper.planner.costmodel import Placement, Policy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 17, 42, 99, 7, 250], [1, 300, 5, 5, 81, 12]]


def threads_by_step(path, dtype: torch.dtype) -> tuple[list[int], set[tuple[int, int]]]:
    """Greedy tokens of a run with half the blocks streamed, and every (tokens a row, torch threads) a block saw."""
    config = ModelConfig.from_folder(path)
    policy = Policy("bf16", Placement(0, 0.5, 0.5), Placement(0, 1, 0), Placement(0, 1, 0), prefetch_depth=1)
    plan = place_model(config, policy, device="cpu", dtype=dtype, batch=len(PROMPTS), max_length=12)
    seen = set()

    def note(module, args):
        if isinstance(module, Block):
            seen.add((args[0].shape[1], torch.get_num_threads()))

    hook = register_module_forward_pre_hook(note)
    try:
        with OffloadedModel(path, plan) as model:
            assert model.resident and model.streamer is not None
            result = generate(model, PROMPTS, max_new_tokens=4, ignore_eos=True)
    finally:
        hook.remove()
    assert torch.get_num_threads() == 1
    return result.token_ids, seen


def test_a_16_bit_prefill_gets_every_core_under_the_runtime_layout_and_decode_one(tiny_checkpoint, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    tokens, seen = threads_by_step(tiny_checkpoint, torch.bfloat16)  # no runtime layout: the caller's one thread
    assert seen == {(6, 1), (1, 1)}
    monkeypatch.setattr(offloaded_model, "runtime_layout_set", True)
    same, seen = threads_by_step(tiny_checkpoint, torch.bfloat16)
    assert same == tokens and seen == {(6, physical_cores()), (1, 1)}
    _, seen = threads_by_step(tiny_checkpoint, torch.float32)
    assert seen == {(6, 1), (1, 1)}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _, seen = threads_by_step(tiny_checkpoint, torch.bfloat16)
    assert seen == {(6, 1), (1, 1)}
