"""A measurement taken while other programs held the cores (load average above the CPU count) says so, so that a
profile from a busy moment (RAM 1.2 GB/s, fp32 0.14 GFLOP/s on this project's VM) is not taken for the machine's."""

from __future__ import annotations

from hivekeeper.core.machine.measurement import Measurement, busy_words


def _measured(load: float) -> Measurement:
    return Measurement("ram_read", "RAM read bandwidth", 3e9, "B/s", 0.1, 2, load)


def test_a_load_above_the_cpu_count_is_called_busy_and_its_load_named():
    assert busy_words([_measured(1.2), _measured(2.0)], cpus=2) == ""  # at most one runnable thread per CPU
    words = busy_words([_measured(1.2), _measured(9.6)], cpus=2)
    assert words.startswith("at load 9.6 on 2 CPUs") and "busy, measure again when quiet" in words
    assert busy_words([], cpus=2) == ""
