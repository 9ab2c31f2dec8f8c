"""`hivekeeper measure`'s micro-benchmark of the packed formats' kernels (issue 16 item 3): one rate per format on the
runtime's own kernels, saved in the profile, and the planner's decode prediction follows it. Nothing is timed against
a goal: the tests check what is measured, where it goes and what the planner does with it."""

from __future__ import annotations

import numpy as np
import pytest

from hivekeeper.core.machine.measure import STEP_REPEATS, measure_packed_kernels, random_packed_matrix
from hivekeeper.core.machine.measurement import PACKED_KERNEL_KEY, WEIGHTS_PER_S, Measurement
from hivekeeper.core.machine.profiles import apply_measurements, comparison_rows, packed_kernel_rates
from hivekeeper.planner.costmodel import Placement, Policy, Workload, evaluate
from hivekeeper.planner.formats import PACKED_FORMATS
from hivekeeper.planner.hardware import ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.models import ModelSpec

SMALL = (64, 256)  # the benchmark's code path on a matrix small enough for a test


@pytest.mark.parametrize("fmt", PACKED_FORMATS)
def test_the_benchmarks_random_matrix_is_a_valid_packed_weight(fmt):
    """Its product on the kernels is the dequantized weights' product within the activations' rounding: the
    benchmark multiplies real blocks (finite scales), as a model's decode does."""
    from hivekeeper.core.runtime.kernels.quant_kernels import activation_error_bound

    matrix = random_packed_matrix(fmt, *SMALL)
    weights = matrix.dequantize()
    assert np.isfinite(weights).all() and np.abs(weights).max() > 0
    x = np.random.default_rng(3).standard_normal(SMALL[1]).astype(np.float32)
    bound = activation_error_bound(weights, x)
    assert np.all(np.abs(matrix.matvec(x) - weights @ x) <= bound + 1e-4 * (1 + np.abs(weights @ x)))


def test_one_rate_per_format_measured_on_the_runtimes_kernels():
    results = measure_packed_kernels(repeats=2, shape=SMALL)
    assert [m.key for m in results] == [f"{PACKED_KERNEL_KEY}{name}" for name in PACKED_FORMATS]
    for m in results:
        # in turn, at least as often as decode steps are timed (a busy spell hits every format alike), the fastest
        assert m.unit == WEIGHTS_PER_S and m.value > 0 and m.repeats == len(m.samples) == STEP_REPEATS
        assert m.value == max(m.samples) and f"[{SMALL[0]}, {SMALL[1]}]" in m.detail and "in turn" in m.detail


def test_the_formats_are_timed_in_turn(monkeypatch):
    """A busy spell on a shared machine must hit every format alike: the products alternate between the formats
    (the real kernels, their calls recorded), rather than all of one format, then all of the next."""
    from hivekeeper.core.runtime.kernels.quant_kernels import QuantizedMatrix

    calls, real = [], QuantizedMatrix.matvec
    monkeypatch.setattr(QuantizedMatrix, "matvec",
                        lambda self, *a, **k: calls.append(self.fmt.name) or real(self, *a, **k))
    measure_packed_kernels(repeats=1, shape=SMALL)
    switches = sum(1 for a, b in zip(calls, calls[1:]) if a != b)
    assert set(calls) == set(PACKED_FORMATS) and switches >= len(PACKED_FORMATS) * STEP_REPEATS


def rate(name: str, value: float) -> Measurement:
    return Measurement(f"{PACKED_KERNEL_KEY}{name}", f"CPU {name} kernel", value, WEIGHTS_PER_S, 0.1, 3, 0.5)


CPU = ComputeDevice(kind="cpu", name="Test CPU", memory_bytes=64 * 10**9, memory_bandwidth=20e9,
                    flops={"fp32": 200e9}, power_watts=65.0, cores=4)
MACHINE = HardwareSpec(id="test", gpus=(), cpu=CPU, disk=DiskSpec(10**12, 1e9, 1e9), network=NetworkSpec(1e9, 1e9, 0.01))
MODEL = ModelSpec(name="m", family="llama", num_layers=16, hidden_size=2048, intermediate_size=5632, num_heads=16,
                  num_kv_heads=16, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
                  max_position_embeddings=2048)


def test_measured_rates_reach_the_planner_and_set_the_packed_decode():
    ram = Measurement("ram_read", "RAM", 20e9, "B/s", 0.0, 3, 0.5)
    measured = [rate("q4_0", 1e9), rate("q8_0", 3e9), ram]
    assert packed_kernel_rates(measured) == {"q4_0": 1e9, "q8_0": 3e9}
    spec = apply_measurements(MACHINE, measured)
    assert spec.cpu.packed_kernels == {"q4_0": 1e9, "q8_0": 3e9}
    policy = Policy(weight_format="q4_0", weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0),
                    activations=Placement(0, 1, 0))
    slow = evaluate(MODEL, spec, policy, Workload(32, 32))
    faster = evaluate(MODEL, apply_measurements(MACHINE, [rate("q4_0", 2e9), rate("q8_0", 3e9), ram]), policy, Workload(32, 32))
    assert slow.bottleneck == "packed kernel compute" and "1 G weights/s (measured)" in slow.bottleneck_detail
    assert 1.5 < faster.decode_tokens_per_s / slow.decode_tokens_per_s <= 2.0
    # an unknown format's key (a newer profile) is left out rather than failing
    assert packed_kernel_rates([rate("q5_k", 1e9)]) == {}


def test_the_measure_table_shows_each_kernels_default_beside_its_measurement():
    from hivekeeper.core.machine.profiles import new_profile

    profile = new_profile(MACHINE)
    profile.measurements = [rate("q4_1", 5e9)]
    rows = {row.quantity: row for row in comparison_rows(MACHINE, profile)}
    assert rows["q4_1 kernel, one row"].measured == 5e9
    assert rows["q8_0 kernel, one row"].measured is None and rows["q8_0 kernel, one row"].catalog > 0
    assert rows["q4_1 kernel, one row"].unit == WEIGHTS_PER_S
