"""Time the policy search over the whole catalog: every model × every machine × every goal.

Prints one JSON line: how many plans, milliseconds per plan (median and max), and the slowest case. The goal is
< 100 ms per plan (FlexGen's linear-program search takes 2–10 s). Each plan is timed as the best of REPEATS runs
(the least disturbed one, as on a shared machine other processes preempt ours); the CPU time per plan is given too.
"""

from __future__ import annotations

import json
import statistics
import time

from hivekeeper.planner.costmodel import Workload
from hivekeeper.planner.hardware_catalog import get_hardware, hardware_ids
from hivekeeper.planner.model_catalog import get_model, model_ids
from hivekeeper.planner.policy import GOALS, search

WORKLOAD = Workload(prompt_len=512, output_len=128)
REPEATS = 3


def main() -> None:
    models = {model_id: get_model(model_id) for model_id in model_ids()}
    machines = {hardware_id: get_hardware(hardware_id) for hardware_id in hardware_ids()}
    search(models[model_ids()[0]], machines[hardware_ids()[0]], "batch", workload=WORKLOAD)  # warm caches
    timings: list[tuple[float, str]] = []
    cpu_ms: list[float] = []
    for model_id, model in models.items():
        for hardware_id, hardware in machines.items():
            for goal in GOALS:
                wall, cpu = [], []
                for _ in range(REPEATS):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    search(model, hardware, goal, workload=WORKLOAD)
                    wall.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - start_cpu)
                timings.append((min(wall) * 1e3, f"{model_id} on {hardware_id}, {goal}"))
                cpu_ms.append(min(cpu) * 1e3)
    ms = [t for t, _ in timings]
    slowest_ms, slowest = max(timings)
    print(json.dumps({
        "bench": "plan_speed", "plans": len(ms), "ms_per_plan_median": round(statistics.median(ms), 2),
        "ms_per_plan_max": round(slowest_ms, 2), "slowest": slowest,
        "cpu_ms_per_plan_median": round(statistics.median(cpu_ms), 2), "cpu_ms_per_plan_max": round(max(cpu_ms), 2),
        "goal_ms": 100,
    }))


if __name__ == "__main__":
    main()
