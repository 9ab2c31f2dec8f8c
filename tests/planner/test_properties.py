"""Properties of the cost model and the search, over random models, machines and policies (hypothesis).

- a prediction is never above its roofline;
- more memory never makes the best plan slower (for a fixed format choice; with --quant auto, never lowers the
  search's objective, speed × the format's quality weight);
- fit is never "local" when a tier's peak exceeds its capacity.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hivekeeper.planner.costmodel import Placement, Policy, Workload, evaluate
from hivekeeper.planner.hardware import ComputeDevice, DiskSpec, HardwareSpec, NetworkSpec
from hivekeeper.planner.models import ModelSpec
from hivekeeper.planner.policy import QUALITY_WEIGHT, Constraints, search

# examples, randomness and deadline come from the hypothesis profile (tests/conftest.py: "ci" by default, derandomized)
SETTINGS = settings(suppress_health_check=[HealthCheck.too_slow])


@st.composite
def models(draw) -> ModelSpec:
    heads = draw(st.sampled_from([8, 16, 32, 64]))
    head_dim = draw(st.sampled_from([64, 128]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 8, heads) if heads % h == 0]))
    experts = draw(st.sampled_from([1, 1, 8]))
    return ModelSpec(
        name="random", family="llama", num_layers=draw(st.integers(2, 96)), hidden_size=heads * head_dim,
        intermediate_size=draw(st.integers(1, 4)) * heads * head_dim * 2, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, vocab_size=draw(st.sampled_from([32000, 128256])),
        tie_word_embeddings=draw(st.booleans()), max_position_embeddings=8192, num_experts=experts,
        experts_per_token=2 if experts > 1 else 1, gated_mlp=draw(st.booleans()),
    )


@st.composite
def machines(draw) -> HardwareSpec:
    cpu = ComputeDevice(kind="cpu", name="cpu", memory_bytes=int(draw(st.floats(4, 512)) * 1e9),
                        memory_bandwidth=draw(st.floats(10, 400)) * 1e9,
                        flops={"fp32": draw(st.floats(0.2, 10)) * 1e12}, power_watts=100.0)
    gpus = ()
    if draw(st.booleans()):
        gpus = (ComputeDevice(kind="gpu", name="gpu", memory_bytes=int(draw(st.floats(4, 192)) * 1e9),
                              memory_bandwidth=draw(st.floats(100, 5000)) * 1e9,
                              flops={"fp16": draw(st.floats(10, 1000)) * 1e12, "fp32": 20e12},
                              power_watts=draw(st.floats(50, 700)),
                              host_link_bandwidth=draw(st.floats(4, 64)) * 1e9),)
    disk = DiskSpec(capacity_bytes=int(draw(st.floats(50, 4000)) * 1e9), read_bandwidth=draw(st.floats(0.1, 8)) * 1e9,
                    write_bandwidth=draw(st.floats(0.1, 8)) * 1e9)
    return HardwareSpec(id="random", gpus=gpus, cpu=cpu, disk=disk, network=NetworkSpec(1e9, 1e9, 0.02))


@st.composite
def placements(draw, allow_disk: bool = True) -> Placement:
    a = draw(st.floats(0, 1))
    b = draw(st.floats(0, 1 - a))
    return Placement(a, b, 1 - a - b) if allow_disk else Placement(a, 1 - a, 0.0)


def _fit_policy_to_machine(policy: Policy, hardware: HardwareSpec) -> Policy:
    """Fold the GPU share onto the CPU tier on a CPU-only machine (its one memory tier)."""
    if hardware.gpus:
        return policy
    fold = lambda p: Placement(0.0, p.gpu + p.cpu, p.disk)  # noqa: E731
    return dataclasses.replace(policy, weights=fold(policy.weights), kv_cache=fold(policy.kv_cache),
                               activations=Placement(0.0, 1.0, 0.0), attention_on_cpu=False)


@SETTINGS
@given(model=models(), hardware=machines(), weights=placements(), cache=placements(), data=st.data())
def test_prediction_never_exceeds_the_roofline(model, hardware, weights, cache, data):
    recompute = data.draw(st.booleans())
    policy = Policy(
        weight_format=data.draw(st.sampled_from(["fp16", "bf16", "fp32", "int8", "nf4"])),
        weights=weights, kv_cache=cache, activations=data.draw(placements(allow_disk=False)),
        micro_batch_size=data.draw(st.integers(1, 512)), num_micro_batches=data.draw(st.integers(1, 16)),
        kv_recompute=recompute, prefetch_depth=data.draw(st.integers(0, 2)),
        attention_on_cpu=False if recompute else data.draw(st.booleans()),
    )
    policy = _fit_policy_to_machine(policy, hardware)
    workload = Workload(prompt_len=data.draw(st.integers(1, 32768)), output_len=data.draw(st.integers(1, 4096)))
    pred = evaluate(model, hardware, policy, workload)
    assert pred.decode_tokens_per_s <= pred.roofline_decode_tokens_per_s * (1 + 1e-12)
    assert pred.prefill_tokens_per_s <= pred.roofline_prefill_tokens_per_s * (1 + 1e-12)
    assert pred.decode_tokens_per_s > 0 and pred.prefill_tokens_per_s > 0


def _grow(hardware: HardwareSpec, gpu_factor: float, ram_factor: float, disk_factor: float) -> HardwareSpec:
    gpus = tuple(dataclasses.replace(g, memory_bytes=int(g.memory_bytes * gpu_factor)) for g in hardware.gpus)
    cpu = dataclasses.replace(hardware.cpu, memory_bytes=int(hardware.cpu.memory_bytes * ram_factor))
    disk = dataclasses.replace(hardware.disk, capacity_bytes=int(hardware.disk.capacity_bytes * disk_factor))
    return dataclasses.replace(hardware, gpus=gpus, cpu=cpu, disk=disk)


def _objective(plan, goal: str) -> float:
    if plan.prediction is None:
        return 0.0
    speed = 1.0 / plan.prediction.runtime_s if goal == "chat" else plan.prediction.throughput_tokens_per_s
    return speed * QUALITY_WEIGHT[plan.prediction.policy.weight_format]


@SETTINGS
@given(model=models(), hardware=machines(), goal=st.sampled_from(["chat", "batch"]),
       quant=st.sampled_from(["none", "int8", "nf4", "auto"]),
       factors=st.tuples(st.floats(1, 4), st.floats(1, 4), st.floats(1, 4)),
       prompt=st.integers(1, 4096), output=st.integers(1, 512))
def test_more_memory_never_makes_the_best_plan_slower(model, hardware, goal, quant, factors, prompt, output):
    workload = Workload(prompt, output)
    constraints = Constraints(quant=quant)
    before = search(model, hardware, goal, constraints, workload)
    after = search(model, _grow(hardware, *factors), goal, constraints, workload)
    if before.prediction is None:
        return
    assert after.prediction is not None
    # ties within 1e-9 go to the simpler plan; that is the only slack
    assert _objective(after, goal) >= _objective(before, goal) * (1 - 1e-8)
    if quant != "auto":
        faster = (after.prediction.throughput_tokens_per_s if goal == "batch" else 1 / after.prediction.runtime_s)
        slower = (before.prediction.throughput_tokens_per_s if goal == "batch" else 1 / before.prediction.runtime_s)
        assert faster >= slower * (1 - 1e-8)


@SETTINGS
@given(model=models(), hardware=machines(), goal=st.sampled_from(["chat", "batch", "serve"]),
       reserve=st.floats(0, 8), prompt=st.integers(1, 8192), output=st.integers(1, 1024))
def test_fit_is_never_local_when_a_peak_exceeds_capacity(model, hardware, goal, reserve, prompt, output):
    reserve_bytes = {"gpu": reserve * 1e9, "cpu": reserve * 1e9}
    plan = search(model, hardware, goal, Constraints(reserve_bytes=reserve_bytes), Workload(prompt, output))
    if plan.fit == "local":
        p = plan.prediction
        assert p is not None and p.fits
        gpu_memory = sum(g.memory_bytes for g in hardware.gpus)
        assert p.peak_memory_bytes["gpu"] <= max(0.0, gpu_memory - reserve * 1e9) + 1
        ram = hardware.cpu.memory_bytes - reserve * 1e9
        assert p.peak_memory_bytes["cpu"] <= ram + 1
        assert p.peak_memory_bytes["disk"] <= hardware.disk.capacity_bytes + 1
    if plan.prediction is None:
        assert plan.fit in ("swarm", "none") and plan.missing_bytes["total"] > 0
