"""The app's local chat places a model as `hivekeeper chat` does: through core/offload/local_plan.plan_local_run.

The app used to choose with its own dtype table and kept a bf16 plan in bf16 on a CPU without native bf16 math (every
matmul emulated); now the dtype is the CLI's (local_plan.compute_dtype, core/machine/cpu_dtype.py).
"""

from __future__ import annotations

import pytest
import torch

from hivekeeper.core.machine.cpu_features import has_half_math
from hivekeeper.core.offload.local_plan import plan_local_run, search_policy
from hivekeeper.core.runtime.checkpoint import load_config
from hivekeeper.core.runtime.demo_model import make_demo_checkpoint
from hivekeeper.gui.services.chat_backends import BackendKey, ChatBackend
from hivekeeper.planner.efficiency import default_efficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware_catalog import apply_host_overrides, get_hardware
from hivekeeper.planner.model_catalog import load_model_spec


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """An 83 MB (in fp32) model published in bf16."""
    return make_demo_checkpoint(tmp_path_factory.mktemp("bf16") / "model", dtype="bf16", layers=4, hidden=512,
                                intermediate=1536, vocab=8000)


def machine_with_ram(checkpoint, fp32_share: float):
    """cpu-generic with RAM for the runtime plus `fp32_share` of the model's fp32 weights."""
    cpu = get_hardware("cpu-generic")
    runtime = default_efficiency(cpu).accelerator.runtime_bytes
    weights = 4 * load_model_spec(str(checkpoint)).total_params()
    return apply_host_overrides(cpu, ram_gb=(runtime + fp32_share * weights) / 1e9)


def test_a_bf16_plan_runs_in_fp32_on_a_cpu_without_bf16_math_as_the_cli_runs_it(bf16_checkpoint):
    assert not has_half_math()  # the suite's pinned CPU (tests/conftest.py: AVX2 and FMA)
    hardware = machine_with_ram(bf16_checkpoint, 0.9)  # fp32 weights do not fit, bf16 ones do
    turn = 512  # the prompt and reply lengths the app plans a chat for
    choice = search_policy(bf16_checkpoint, batch=1, prompt_len=turn, max_new_tokens=turn, hardware=hardware)
    # the planner plans what runs: fp32 (streamed) where the CPU would run a bf16 plan in fp32 (issue 22, session 12)
    assert choice.policy.weight_format == "fp32"
    backend = ChatBackend(BackendKey("local", str(bf16_checkpoint)), hardware, lambda words: None)
    try:
        plan = backend.runner.plan
        assert plan.dtype == torch.float32 and next(backend.runner.head.parameters()).dtype == torch.float32
        _, cli_plan = plan_local_run("auto", bf16_checkpoint, load_config(bf16_checkpoint), batch=1, prompt_len=turn,
                                     max_new_tokens=turn, max_length=backend.context, hardware=hardware)
        assert plan == cli_plan
    finally:
        backend.close()


def test_a_model_that_fits_nowhere_points_to_the_swarm(bf16_checkpoint):
    with pytest.raises(InputError, match="does not fit on this machine.*Chat through the swarm instead"):
        ChatBackend(BackendKey("local", str(bf16_checkpoint)), machine_with_ram(bf16_checkpoint, 0.01),
                    lambda words: None)
