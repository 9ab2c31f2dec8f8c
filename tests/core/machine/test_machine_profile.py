"""Machine profiles: fingerprints, measured numbers in the spec, atomic saves, and the planner using them."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hivekeeper.core.machine.detect import detect_hardware
from hivekeeper.core.machine.profiles import (
    MachineProfile,
    apply_measurements,
    comparison_rows,
    detect_or_load_profile,
    load_machine_profile,
    load_profile,
    machine_fingerprint,
    new_profile,
    profile_path,
    save_profile,
)
from hivekeeper.core.machine.measure import TINY, run_benchmarks
from hivekeeper.planner.calibration import is_calibrated, measured_efficiency
from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware_catalog import (CPU_SOFTWARE_HALF_SLOWDOWN, GIB, get_hardware, hardware_from_dict,
                                                hardware_to_json)



@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    folder = tmp_path / "config"
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(folder))
    return folder


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Real measurements of this machine at tiny sizes (RAM, fp32/bf16 matmuls, disk)."""
    return run_benchmarks(TINY, disk_folder=tmp_path_factory.mktemp("disk"), gpu=False)


def test_fingerprint_identifies_hardware_not_free_space():
    spec = get_hardware("cpu-generic")
    same = dataclasses.replace(spec, disk=dataclasses.replace(spec.disk, capacity_bytes=1_000_000_000))
    assert machine_fingerprint(spec) == machine_fingerprint(same)
    bigger = dataclasses.replace(spec.cpu, memory_bytes=spec.cpu.memory_bytes + 4 * GIB)
    more_ram = dataclasses.replace(spec, cpu=bigger)
    with_gpu = dataclasses.replace(spec, gpus=get_hardware("t4").gpus)
    fingerprints = {machine_fingerprint(s) for s in (spec, more_ram, with_gpu)}
    assert len(fingerprints) == 3 and all(len(f) == 16 for f in fingerprints)


def test_a_real_measurement_pools_the_few_row_reads_of_every_reading(measured):
    """Session 17: the four later readings of the streaming rate time the spans' 4- and 8-row steps too (real steps
    here, at TINY's sizes), and each width's reads are the median of the five readings' (at least 1)."""
    from hivekeeper.core.machine.measurement import ROW_READS_AT_KEY

    few = [m for m in measured if m.key.startswith(ROW_READS_AT_KEY)]
    assert len(few) == 4 and all(m.repeats == len(m.samples) == 5 and m.value >= 1.0 for m in few)
    assert all(m.value == pytest.approx(max(1.0, sorted(m.samples)[2])) for m in few)


def test_measured_numbers_replace_estimates_with_their_sources(measured):
    spec = detect_hardware()
    hardware = apply_measurements(spec, measured, when=1.7e9)
    by_key = {m.key: m for m in measured}
    # the sum()'s rate, or the decode steps' where they read RAM faster (issue 23: profiles.ram_bandwidth)
    assert hardware.cpu.memory_bandwidth == pytest.approx(
        max(by_key["ram_read"].value, by_key["cpu_weight_stream"].value), rel=1e-6)
    assert hardware.cpu.sources["memory_bandwidth"].startswith("measured")
    assert set(hardware.cpu.flops) == {"fp32", "bf16"}  # one table, measured: bf16 is never assumed fp32-fast
    bf16, fp32 = by_key["cpu_matmul_bf16_prefill"].value, hardware.cpu.flops["fp32"]
    # the suite's CPU has no native bf16 math (tests/conftest.py), so 16-bit plans compute in fp32 here: a bf16 rate
    # measured at or above fp32's (a host that has it) is seen as converted, a lower one is kept (cpu_dtype.py)
    expected = bf16 if bf16 < fp32 else fp32 / CPU_SOFTWARE_HALF_SLOWDOWN
    assert hardware.cpu.flops["bf16"] == pytest.approx(expected, rel=1e-3)
    assert hardware.disk.read_bandwidth == pytest.approx(by_key["disk_read"].value, rel=1e-6)
    assert "posix_fadvise" in hardware.disk.sources["read_bandwidth"]
    assert hardware.cpu.memory_bytes == spec.cpu.memory_bytes  # sizes stay detected
    # the measured machine is a valid hardware document (what `measure --out` writes)
    again = hardware_from_dict(json.loads(json.dumps(hardware_to_json(hardware))), where="test")
    assert again.cpu.memory_bandwidth == hardware.cpu.memory_bandwidth
    # decode's weight streaming, measured against the RAM bandwidth, travels with the document
    streaming = hardware.cpu.decode_streaming
    assert streaming.bandwidth_fraction == pytest.approx(
        min(1.0, by_key["cpu_weight_stream"].value / hardware.cpu.memory_bandwidth), rel=1e-6)
    assert streaming.small_row_reads == pytest.approx(max(1.0, by_key["cpu_small_rows_reads"].value))
    assert again.cpu.decode_streaming.small_row_reads == pytest.approx(streaming.small_row_reads, abs=1e-4)
    efficiency = measured_efficiency(hardware)
    assert efficiency.accelerator.disk_fraction == 1.0  # measured: not discounted
    # the CPU's fraction of the measured bandwidth is what the decode chain reached, not an assumed 1
    assert efficiency.accelerator.bandwidth_fraction == pytest.approx(max(0.05, streaming.bandwidth_fraction))
    assert efficiency.accelerator.weight_reread_rows == pytest.approx(streaming.small_row_reads)
    # the per-block cost is the measured one of whole decode steps (issue 23), not a default plus start-ups
    assert streaming.block_overhead_s == pytest.approx(by_key["cpu_decode_block_overhead"].value)
    assert efficiency.accelerator.layer_overhead_s == pytest.approx(streaming.block_overhead_s)
    # the Hardware page shows the measured streaming beside the cost model's default assumption
    rows = {r.quantity: r for r in comparison_rows(spec, MachineProfile("x", {}, 1.7e9, measured))}
    stream = rows["decode weight streaming"]
    assert stream.measured == by_key["cpu_weight_stream"].value
    assert stream.catalog == pytest.approx(0.5 * spec.cpu.memory_bandwidth)


def test_gpu_and_network_measurements_apply_to_the_right_fields(measured):
    from hivekeeper.core.machine.measure import Measurement

    spec = get_hardware("t4")
    spec = dataclasses.replace(spec, gpus=spec.gpus * 2)
    extra = [Measurement("gpu0_memory_read", "GPU memory", 290e9, "B/s", 0.01, 3, 0.5),
             Measurement("gpu0_matmul_fp16_prefill", "fp16", 40e12, "FLOP/s", 0.02, 3, 0.5),
             Measurement("gpu0_h2d_pinned", "h2d", 11.5e9, "B/s", 0.0, 3, 0.5),
             Measurement("peer_rtt:a:1", "rtt a", 0.020, "s", 0.1, 3, 0.5),
             Measurement("peer_rtt:b:1", "rtt b", 0.040, "s", 0.1, 3, 0.5),
             Measurement("peer_rtt:c:1", "rtt c", 0.100, "s", 0.1, 3, 0.5)]
    hardware = apply_measurements(spec, extra)
    for gpu in hardware.gpus:  # both identical GPUs
        assert gpu.memory_bandwidth == 290e9 and gpu.flops == {"fp16": 40e12} and gpu.host_link_bandwidth == 11.5e9
    assert hardware.network.rtt_s == pytest.approx(0.040)  # the median peer
    rows = comparison_rows(spec, MachineProfile("x", {}, 1.0, extra))
    link = next(r for r in rows if r.quantity == "host→GPU, pinned")
    assert link.catalog == spec.gpus[0].host_link_bandwidth and link.measured == 11.5e9


def test_profile_saves_atomically_and_loads_back(config_dir, measured):
    spec = detect_hardware()
    profile = new_profile(spec)
    profile.measurements, profile.measured_at, profile.threads = measured, 1.7e9, 2
    path = save_profile(profile)
    assert path == profile_path(profile.fingerprint) and path.parent == config_dir / "profiles"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    loaded = load_machine_profile(spec)
    assert loaded is not None and loaded.fingerprint == profile.fingerprint and not loaded.calibrated
    assert [m.as_dict() for m in loaded.measurements] == [m.as_dict() for m in measured]
    other = dataclasses.replace(spec, cpu=dataclasses.replace(spec.cpu, name="another CPU"))
    assert load_machine_profile(other) is None


def test_bad_profile_files_name_the_file(config_dir):
    spec = detect_hardware()
    path = profile_path(machine_fingerprint(spec))
    path.parent.mkdir(parents=True)
    path.write_text("{ not json")
    with pytest.raises(InputError, match=str(path)):
        load_machine_profile(spec)
    path.write_text(json.dumps({"version": 99, "fingerprint": "x"}))
    with pytest.raises(InputError, match="version"):
        load_profile(path)
    path.write_text(json.dumps({"version": 1, "fingerprint": "x", "measurements": [{"value": 1}]}))
    with pytest.raises(InputError, match="measurements"):
        load_profile(path)
    # a value no measurement gives (hand-edited): named, not read as is (a bf16 step ratio of -3 flipped the rule)
    for value in (-3, 0, "NaN"):
        ratio = {"key": "cpu_decode_step_bf16_vs_fp32", "value": value, "unit": "x"}
        path.write_text(json.dumps({"version": 1, "fingerprint": "x", "measurements": [ratio]}).replace('"NaN"', "NaN"))
        with pytest.raises(InputError, match=r"field 'measurements\[0\]\.value' \(measurement 'cpu_decode_step_bf16"
                                             r"_vs_fp32'\) must be .*delete the file and run `hivekeeper measure` "
                                             r"again"):
            load_profile(path)


@pytest.mark.parametrize("key, unit, value, words", [
    ("ram_read", "B/s", -5, "must be at least 0 (in B/s), got -5"),  # the newcomer's edit
    ("cpu_decode_block_overhead", "s", -0.001, "must be at least 0 (in s), got -0.001"),
    ("ram_read", "B/s", "fast", 'must be a number, got "fast"'),
])
def test_a_measurement_no_benchmark_gives_stops_the_plan_naming_the_field(config_dir, measured, capsys, key, unit,
                                                                         value, words):
    """A newcomer edited a saved profile's `ram_read` to -5: `plan` exited 0 with another RAM figure. Now it is one
    error naming the file and the field, before anything is planned or measured."""
    from hivekeeper.core.cli.main import main

    profile = new_profile(detect_hardware())
    profile.measurements, profile.measured_at = measured, 1.7e9
    path = save_profile(profile)
    doc = json.loads(path.read_text())
    index = next(i for i, m in enumerate(doc["measurements"]) if m["key"] == key)
    assert doc["measurements"][index]["unit"] == unit
    doc["measurements"][index]["value"] = value
    path.write_text(json.dumps(doc))
    assert main(["plan", "--model", "meta-llama/Llama-3.2-1B", "--json"]) == 2
    captured = capsys.readouterr()
    assert not captured.out and "Traceback" not in captured.err
    assert f"{path}: field 'measurements[{index}].value' (measurement {key!r}) {words}" in captured.err, captured.err
    assert "delete the file and run `hivekeeper measure` again" in captured.err


def test_a_cost_the_noise_did_not_resolve_is_saved_as_0_and_read_back(config_dir, measured):
    """0 s is a measurement (a fixed cost below the noise), as is a rate of 0 (the readers take it as not measured):
    only what none gives is refused."""
    profile = new_profile(detect_hardware())
    profile.measurements = [dataclasses.replace(m, value=0.0) if m.unit == "s" or m.key == "disk_write" else m
                            for m in measured]
    assert any(m.unit == "s" for m in measured) and any(m.key == "disk_write" for m in measured)
    path = save_profile(profile)
    assert [m.value for m in load_profile(path).measurements] == pytest.approx([m.value for m in profile.measurements],
                                                                               rel=1e-5)  # saved to 6 digits


def test_planner_takes_the_saved_profile_for_this_machine(config_dir, measured):
    hardware, efficiency = detect_or_load_profile()
    assert efficiency is None  # nothing saved: detected numbers, default factors
    profile = new_profile(detect_hardware())
    profile.measurements, profile.measured_at = measured, 1.7e9
    save_profile(profile)
    hardware, efficiency = detect_or_load_profile()
    ram = max(m.value for m in measured if m.key in ("ram_read", "cpu_weight_stream"))  # profiles.ram_bandwidth
    assert hardware.cpu.memory_bandwidth == pytest.approx(ram, rel=1e-5)  # saved with 6 significant digits
    assert efficiency.name.startswith("measured:") and not is_calibrated(efficiency.name)


def test_measure_then_plan_from_the_command_line(config_dir, tmp_path, capsys, monkeypatch):
    from hivekeeper.core.cli.main import main
    from hivekeeper.core.machine.measurement import SIZES_ENV

    monkeypatch.setenv(SIZES_ENV, "huge")
    assert main(["measure", "--quick", "--no-disk"]) == 2
    err = capsys.readouterr().err
    assert f"{SIZES_ENV}='huge'" in err and "tiny" in err and "Traceback" not in err
    monkeypatch.setenv(SIZES_ENV, "tiny")  # the app's and the commands' switch: the wiring is what is tested here
    out = tmp_path / "machine.json"
    assert main(["measure", "--quick", "--no-disk", "--repeats", "1", "--json", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["profile"] and (config_dir / "profiles").is_dir()
    assert {m["key"] for m in report["measurements"]} >= {"ram_read", "cpu_matmul_fp32_prefill"}
    assert report["cpu_sixteen_bit"]["dtype"] == "fp32"  # the suite's CPU has no native bf16 math
    assert hardware_from_dict(json.loads(out.read_text()), where=str(out)).cpu.sources["memory_bandwidth"] \
        .startswith("measured")
    assert main(["plan", "--model", "meta-llama/Llama-3.2-1B", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["efficiency"].startswith("measured:")
    # the measured hardware file alone (no profile): its measured numbers are not discounted a second time
    assert main(["plan", "--model", "meta-llama/Llama-3.2-1B", "--hardware", str(out), "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert from_file["efficiency"] == auto["efficiency"]
    assert from_file["decode_tokens_per_s"] == pytest.approx(auto["decode_tokens_per_s"], rel=1e-3)  # JSON rounding
    assert main(["measure", "--peer", "nowhere", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "peer 'nowhere'" in err and "Traceback" not in err


def test_profiles_load_without_torch(config_dir, measured):
    """The desktop app reads profiles in its own process, which must not import torch."""
    import subprocess
    import sys

    profile = new_profile(get_hardware("cpu-generic"))
    profile.measurements, profile.measured_at = measured, 1.7e9
    path = save_profile(profile)
    code = ("import sys; from hivekeeper.core.machine.profiles import comparison_rows, load_profile; "
            "from hivekeeper.planner.hardware_catalog import get_hardware; p = load_profile(sys.argv[1]); "
            "rows = [r for r in comparison_rows(get_hardware('cpu-generic'), p) if r.measured is not None]; "
            "print(len(p.measurements), len(rows), 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    count, rows, torch_loaded = result.stdout.split()
    assert int(count) == len(measured) and int(rows) >= 3 and torch_loaded == "False"
