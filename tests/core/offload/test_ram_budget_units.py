"""A RAM budget reaches the planner in bytes: the machine it plans for has the budget plus the runtime it reserves
(local_plan.with_ram_budget). Until session 11 the sum was divided by GiB and read as decimal GB, 7% short: 123 MB
of the offload bench's 176 MB budget, so the planner put nearly every block on disk (issue 22)."""

from __future__ import annotations

import pytest

from hivekeeper.core.offload.local_plan import with_ram_budget
from hivekeeper.planner.efficiency import default_efficiency
from hivekeeper.planner.hardware_catalog import get_hardware


@pytest.mark.parametrize("hardware_id", ["cpu-generic", "rtx-4090"])
def test_the_planner_gets_the_budget_plus_its_runtime_in_bytes(hardware_id):
    hardware = get_hardware(hardware_id)
    eff = default_efficiency(hardware)
    runtime = (eff.host if hardware.has_gpu else eff.accelerator).runtime_bytes
    for budget in (176_205_300, 3 * 10**9):
        ram = with_ram_budget(hardware, budget).cpu.memory_bytes
        assert abs(ram - (budget + runtime)) <= 1
    assert with_ram_budget(hardware, 10**9).cpu.memory_bytes < with_ram_budget(hardware, 2 * 10**9).cpu.memory_bytes
