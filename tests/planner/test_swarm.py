"""Swarm sizing: blocks that fit, per-block speeds, span choice and moving (Petals' balancing rule, which the swarm
server runs too), a client's chain, three-state fit."""

from __future__ import annotations

import math

import pytest

from hivekeeper.planner.costmodel import block_weight_bytes, machine_view
from hivekeeper.planner.efficiency import default_efficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware_catalog import get_hardware
from hivekeeper.planner.model_catalog import get_model
from hivekeeper.planner.swarm import (FORWARD_TOKENS, Hop, ServerSpan, block_speed, block_throughputs, choose_span,
                                      choose_start, default_cache_tokens, plan_server, session_speed, should_move,
                                      span_throughput)


def test_blocks_that_fit_by_hand():
    model, hardware = get_model("meta-llama/Llama-2-70b-hf"), get_hardware("rtx-3090")
    server = plan_server(model, hardware, quant="nf4")
    numbers_block = block_weight_bytes(model, "nf4")
    cache = 16384 * 2 * 8 * 128 * 2  # Petals' 16384 tokens for a grouped-query model
    usable = hardware.gpus[0].memory_bytes - server.workspace_bytes
    assert server.num_blocks == math.floor(usable / (numbers_block + cache))
    assert server.peak_memory_bytes <= hardware.gpus[0].memory_bytes
    assert server.tier == "gpu" and server.weight_format == "nf4"


def test_auto_quant_keeps_16_bits_when_everything_fits():
    small = plan_server(get_model("meta-llama/Llama-2-7b-hf"), get_hardware("a100-80gb"))
    assert small.weight_format == "fp16" and small.num_blocks == 32
    big = plan_server(get_model("meta-llama/Llama-2-70b-hf"), get_hardware("a100-80gb"))
    assert big.weight_format == "nf4" and big.num_blocks == 80
    cpu = plan_server(get_model("meta-llama/Llama-2-7b-hf"), get_hardware("cpu-generic"))
    assert cpu.tier == "cpu" and cpu.weight_format == "fp32"  # no native 16-bit math on that CPU
    assert default_cache_tokens(get_model("meta-llama/Llama-2-7b-hf")) == 4096


def test_block_speed_stays_under_its_roofline_and_forward_is_faster_per_token():
    hardware = get_hardware("a100-80gb")
    machine, eff = machine_view(hardware), default_efficiency(hardware)
    speed = block_speed(get_model("meta-llama/Llama-2-70b-hf"), machine, eff, "nf4")
    assert speed.inference_rps <= speed.roofline_inference_rps
    assert speed.forward_rps <= speed.roofline_forward_rps
    assert speed.forward_rps > 10 * speed.inference_rps  # a 1024-token forward reuses each weight read


def test_advertised_throughput_formula():
    # Petals: min(forward_rps / ((blocks + 1) / 2), network_rps × (0.2 if relayed))
    assert span_throughput(1000.0, 9, None) == pytest.approx(200.0)
    assert span_throughput(1000.0, 9, 150.0) == pytest.approx(150.0)
    assert span_throughput(1000.0, 9, 150.0, using_relay=True) == pytest.approx(30.0)
    server = plan_server(get_model("meta-llama/Llama-2-70b-hf"), get_hardware("rtx-3090"))
    network = get_hardware("rtx-3090").network
    assert server.network_rps == pytest.approx(min(network.upload_bps, network.download_bps) / (16 * 8192))


def test_choose_span_fills_the_weakest_blocks():
    assert choose_span(10, [], 4) == 0  # empty swarm: lowest start
    spans = [ServerSpan(0, 4, 1.0), ServerSpan(7, 10, 1.0)]
    assert choose_span(10, spans, 3) == 4  # blocks 4-6 have nobody
    # a gap of two blocks and a span of three: cover the gap, then the weaker neighbour side
    spans = [ServerSpan(0, 5, 1.0), ServerSpan(7, 10, 5.0)]
    assert choose_span(10, spans, 3) == 4
    assert list(block_throughputs(10, spans)) == [1.0] * 5 + [0.0] * 2 + [5.0] * 3
    with pytest.raises(InputError):
        choose_span(10, spans, 11)


def test_choose_span_ties_go_to_the_lowest_start():
    spans = [ServerSpan(0, 10, 1.0)]
    assert choose_span(10, spans, 5) == 0


def test_should_move():
    # server 2 doubles up on blocks 0-4 while 5-9 have only one server: moving there doubles the weakest block
    spans = [ServerSpan(0, 5, 1.0), ServerSpan(5, 10, 1.0), ServerSpan(0, 5, 1.0)]
    assert should_move(10, spans, 2) is None  # before 1.0, after 1.0: nothing gained
    thin = [ServerSpan(0, 10, 1.0), ServerSpan(0, 5, 3.0), ServerSpan(0, 5, 3.0)]
    assert should_move(10, thin, 2) == 5  # min before 1, min after 4: ratio 0.25 < 0.75
    balanced = [ServerSpan(0, 5, 1.0), ServerSpan(5, 10, 1.0)]
    assert should_move(10, balanced, 0) is None



def test_new_server_takes_the_weakest_window():
    assert choose_start([0, 0, 0, 0, 0, 0], 2) == 0  # ties -> lowest start
    assert choose_start([5, 5, 0, 0, 0, 0], 2) == 2
    assert choose_start([5, 5, 5, 5, 0, 0], 2) == 4
    assert choose_start([3, 1, 2, 9, 9], 3) == 0  # sorted (1, 2, 3) < (1, 2, 9)
    with pytest.raises(InputError):
        choose_start([1, 2], 3)


def test_three_servers_joining_in_turn_cover_the_model():
    spans = []
    for _ in "abc":
        start = choose_start(block_throughputs(6, spans), 2)
        spans.append(ServerSpan(start, start + 2, 1.0))
    assert sorted((s.start, s.end) for s in spans) == [(0, 2), (2, 4), (4, 6)]


def test_server_moves_to_fill_a_gap_and_stays_when_balanced():
    # b left: blocks 2..3 are uncovered, a and c both hold 0..1
    spans = [ServerSpan(0, 2, 1.0), ServerSpan(0, 2, 1.0), ServerSpan(4, 6, 1.0)]  # a, c, d
    assert should_move(6, spans, 0) == 2
    balanced = [ServerSpan(0, 2, 1.0), ServerSpan(2, 4, 1.0), ServerSpan(4, 6, 1.0)]
    assert all(should_move(6, balanced, index) is None for index in range(3))
    # moving cannot close every gap (three blocks, one spare server of two): stay
    assert should_move(6, [ServerSpan(0, 2, 1.0)], 0) is None
    with pytest.raises(InputError):
        should_move(6, balanced, 3)


def test_small_improvements_do_not_trigger_a_move():
    # T = [1.0, 1.6]; moving a to block 0 gives [1.2, 1.4]: ratio 1.0 / 1.2 = 0.83 > 0.75 -> stay,
    # but a stricter quality moves
    spans = [ServerSpan(1, 2, 0.2), ServerSpan(0, 2, 1.0), ServerSpan(1, 2, 0.4)]  # a, b, c
    assert should_move(2, spans, 0) is None
    assert should_move(2, spans, 0, balance_quality=0.9) == 0


def test_move_simulation_re_places_the_other_servers_too():
    # T = [2, 6]. Server 1 moving alone gives [6, 2]: min 2 -> 2, no gain. But then server 2 follows greedily to
    # block 1: [4, 4], min 2 -> 4, ratio 0.5 < 0.75 -> move (Petals simulates everyone, not just the mover)
    spans = [ServerSpan(1, 2, 2.0), ServerSpan(1, 2, 4.0), ServerSpan(0, 1, 2.0)]
    assert should_move(2, spans, 1) == 0
    assert should_move(2, spans, 1, balance_quality=0.5) is None  # 0.5 is not below 0.5

def test_session_speed_by_hand():
    hops = [Hop(num_blocks=40, inference_rps=1000.0, forward_rps=20000.0, rtt_s=0.05, bandwidth_bps=100e6),
            Hop(num_blocks=40, inference_rps=500.0, forward_rps=10000.0, rtt_s=0.10, bandwidth_bps=100e6)]
    hidden_bits = 2 * 8192 * 2 * 8  # hidden state there and back, 16-bit
    step = (0.05 + 40 / 1000 + hidden_bits / 100e6) + (0.10 + 40 / 500 + hidden_bits / 100e6)
    speed = session_speed(hops, hidden_size=8192)
    assert speed.step_s == pytest.approx(step)
    assert speed.inference_steps_per_s == pytest.approx(1 / step)
    assert speed.slowest_hop == 1
    forward = sum(h.rtt_s + FORWARD_TOKENS * h.num_blocks / h.forward_rps + FORWARD_TOKENS * hidden_bits / 100e6
                  for h in hops)
    assert speed.forward_tokens_per_s == pytest.approx(FORWARD_TOKENS / forward)
    with pytest.raises(InputError):
        session_speed([], hidden_size=8192)
    with pytest.raises(InputError):
        Hop(num_blocks=0, inference_rps=1.0, forward_rps=1.0, rtt_s=0.0, bandwidth_bps=1.0)
