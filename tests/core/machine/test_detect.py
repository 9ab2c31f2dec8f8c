"""Detection of this machine, and `hivekeeper detect`."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pytest
import torch

from hivekeeper.core.machine import detect
from hivekeeper.core.machine.cpu_features import cpu_flags, cpuinfo_fields
from hivekeeper.core.cli.main import main
from hivekeeper.planner.hardware_catalog import hardware_to_json, load_hardware_json

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only result of a GPU-less machine")


@pytest.fixture(scope="module")
def detected(tmp_path_factory):
    return detect.detect_hardware(tmp_path_factory.mktemp("data"))


# What the machine is, read here from the kernel's own files and calls (detection asks psutil).
def ram_bytes() -> int:
    """MemTotal of /proc/meminfo (Linux), else physical pages × page size."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel's "kB" are KiB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def physical_cores() -> int | None:
    """Distinct sets of hardware threads sharing a core, from /sys (Linux); None where it is not there."""
    pattern = "/sys/devices/system/cpu/cpu[0-9]*/topology/{}"
    lists = glob.glob(pattern.format("core_cpus_list")) or glob.glob(pattern.format("thread_siblings_list"))
    return len({Path(path).read_text().strip() for path in lists}) or None


def disk_bytes(folder: Path) -> int:
    """Free space (for unprivileged users) of the file system holding `folder`: its available blocks × the fragment
    size, as statvfs reports them."""
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def test_ram_cores_and_disk_are_the_real_ones(detected, tmp_path_factory):
    assert detected.cpu.memory_bytes == ram_bytes()
    cores = physical_cores()
    if cores is None:  # no /sys topology: at least no more cores than hardware threads
        assert 1 <= detected.cpu.cores <= os.cpu_count()
    else:
        assert detected.cpu.cores == cores
    # the free space (issue 14 item 3); others write to this disk meanwhile, hence the 1 GB
    assert detected.disk.capacity_bytes == pytest.approx(disk_bytes(tmp_path_factory.getbasetemp()), abs=1e9)
    assert detected.cpu.sources["memory_bytes"] == "detected"


def test_every_number_is_positive_and_estimates_say_so(detected):
    cpu = detected.cpu
    assert cpu.flops["fp32"] > 0 and cpu.memory_bandwidth > 0 and cpu.power_watts > 0
    assert detected.disk.read_bandwidth > 0 and detected.disk.write_bandwidth > 0
    assert detected.network.upload_bps > 0 and detected.network.rtt_s > 0
    assert cpu.sources["memory_bandwidth"].startswith("estimated")
    assert cpu.sources["flops"].startswith("estimated")
    assert detected.disk.sources["read_bandwidth"].startswith("estimated")
    assert detected.network.sources["rtt_s"].startswith("default")
    # conservative: no more than 50 GB/s of RAM bandwidth is assumed before it is measured
    assert cpu.memory_bandwidth <= 50e9


@needs_no_gpu
def test_cpu_only_machine_gives_cpu_only_spec(detected):
    assert detected.gpus == ()
    assert not detected.has_gpu and detected.accelerator is detected.cpu
    assert "no GPU" in detected.description


def test_cpu_flops_follow_cores_clock_and_simd(detected):
    assert cpu_flags() == frozenset({"sse2", "avx", "avx2", "fma"})  # pinned for the suite (tests/conftest.py)
    clock_ghz, _ = detect.cpu_clock_ghz(cpuinfo_fields())
    # clocks move between reads: allow 20%
    assert detected.cpu.flops["fp32"] == pytest.approx(detected.cpu.cores * clock_ghz * 1e9 * 32, rel=0.2)


def test_missing_data_dir_uses_the_nearest_existing_parent(tmp_path):
    spec = detect.detect_hardware(tmp_path / "not" / "yet" / "created")
    # free space moves while other tests write (session 22: 8 KiB between the two reads); the source names the folder
    assert spec.disk.capacity_bytes == pytest.approx(disk_bytes(tmp_path), abs=64 << 20)
    assert str(tmp_path) in spec.disk.sources["capacity_bytes"]


def test_nvml_absence_is_not_an_error():
    devices = detect.nvml_devices()
    assert isinstance(devices, dict)
    gpus, note = detect.detect_cuda_gpus()
    if not torch.cuda.is_available():
        assert gpus == [] and note


def test_detected_spec_round_trips(detected):
    doc = json.loads(json.dumps(hardware_to_json(detected)))
    from hivekeeper.planner.hardware_catalog import hardware_from_dict

    assert hardware_from_dict(doc, default_id=detected.id) == detected


def test_cli_detect_out_writes_a_loadable_file(tmp_path, capsys):
    out = tmp_path / "me.json"
    assert main(["detect", "--out", str(out), "--data-dir", str(tmp_path)]) == 0
    loaded = load_hardware_json(out)
    assert hardware_to_json(loaded) == {**json.loads(out.read_text())}
    assert loaded.cpu.memory_bytes == ram_bytes()
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind


def test_cli_detect_json_and_text(tmp_path, capsys, monkeypatch):
    # no profile, so the estimates (a profile's measured numbers: tests/core/cli/test_cmd_detect.py)
    monkeypatch.setenv("HIVEKEEPER_CONFIG_DIR", str(tmp_path / "config"))
    assert main(["detect", "--json", "--data-dir", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cpu"]["cores"] >= 1 and doc["id"] == "detected"
    assert main(["detect", "--data-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "RAM:" in text and "[estimated]" in text
    from hivekeeper.core.runtime.kernels import native_kernels

    assert f"CPU decode kernels: {native_kernels.status()}" in text  # "on (...)" or "off: <why>"
    assert "CPU flags: avx2 fma (pinned by HIVEKEEPER_CPU_FLAGS)" in text  # the suite's CPU (tests/conftest.py)
    assert "CPU 16-bit plans: fp32 (no native bf16 math" in text  # the other cases: test_cpu_cases.py


def test_cli_detect_bad_out_folder_is_one_line_error(tmp_path, capsys):
    out = tmp_path / "missing" / "me.json"
    assert main(["detect", "--out", str(out), "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err
    assert not out.exists()
