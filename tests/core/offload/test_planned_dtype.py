"""The planner's 16-bit format is the one the engine computes: on a CPU whose 16-bit choice is bf16 (native bf16
math and a measured bf16 decode step faster than fp32, cpu_dtype), a batch plan for an fp32 checkpoint asks for bf16
and the engine runs bf16 blocks. Before, the planner asked for fp16, which such a CPU
runs in fp32: blocks twice the bytes the plan had placed, and fp32 matmuls where bf16 ones (AMX) were ~3x faster at
batch 128 (docs/performance.md, offloaded batch throughput). Without native bf16 the engine computes fp32, whatever
16-bit format the plan names.
"""

from __future__ import annotations

import pytest
import torch

from hivekeeper.core.offload.local_plan import plan_local_run
from hivekeeper.core.runtime.model import ModelConfig

def batch_plan(path):
    config = ModelConfig.from_folder(path)
    return plan_local_run("auto", path, config, batch=16, prompt_len=8, max_new_tokens=8, max_length=32,
                          device="cpu")


@pytest.mark.parametrize("native_bf16", [True, False])
def test_the_batch_plans_16_bit_format_is_the_dtype_the_engine_computes(tiny_checkpoint, bf16_measured_cpu,
                                                                        native_bf16):
    bf16_measured_cpu(native_bf16)  # the profile (conftest.py) says bf16 is faster; the flags say if it is native
    choice, plan = batch_plan(tiny_checkpoint)
    assert choice.source == "auto"
    if native_bf16:
        assert choice.policy.weight_format == "bf16" and plan.dtype == torch.bfloat16
    else:  # no native 16-bit math: a 16-bit plan would be run in fp32, so fp32 is planned (session 12; it planned
        # fp16 before, counting 2 bytes a weight the engine then held in 4)
        assert choice.policy.weight_format == "fp32" and plan.dtype == torch.float32
