"""Issue 14 item 3: a plan leaves memory free by default (the headroom rule of docs/cost-model.md), counts the disk's
free space rather than its size, and says what it keeps free; `--reserve-gb` replaces the rule and is refused when it
leaves nothing. Through the real `hivekeeper plan` command (one child process; the variations run its `main()` in this
process, the `cli` fixture) and this machine's detected spec."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest

from hivekeeper.core.machine.detect import detect_hardware
from hivekeeper.planner.hardware import GIB, HEADROOM_RULE, default_headroom, tier_headroom
from hivekeeper.planner.hardware_catalog import get_hardware, hardware_from_dict, hardware_to_json

MODEL = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


def plan(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hivekeeper.core.cli.main", "plan", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def data_dir() -> str:
    """The suite's data folder, made here: each test reads its filesystem's free space (none may rely on another
    test having made it)."""
    folder = os.environ["HIVEKEEPER_DATA_DIR"]
    os.makedirs(folder, exist_ok=True)
    return folder


def test_detected_disk_is_the_free_space_and_ram_in_use_is_read(data_dir):
    folder = data_dir
    before = psutil.disk_usage(folder)
    spec = detect_hardware(folder)
    after = psutil.disk_usage(folder)
    low, high = min(before.free, after.free), max(before.free, after.free)
    assert low - 1e9 <= spec.disk.capacity_bytes <= high + 1e9  # others write to this disk meanwhile
    assert spec.disk.capacity_bytes < before.total or before.free == before.total
    assert "free space" in spec.disk.sources["capacity_bytes"]
    assert 0 < spec.cpu.in_use_bytes < spec.cpu.memory_bytes
    assert hardware_from_dict(hardware_to_json(spec)) == spec  # what other programs hold survives the app's probe


def test_plan_auto_keeps_the_headroom_free_and_says_so(cli, data_dir):
    result = plan("--model", MODEL, "--hardware", "auto", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    kept, capacity = data["kept_free"]["bytes"], data["capacity_bytes"]
    ram = psutil.virtual_memory().total
    assert kept["cpu"] > max(2 * GIB, 0.10 * ram)  # the rule's floor, plus what other programs hold now
    assert kept["cpu"] < ram
    assert capacity["cpu"] + kept["cpu"] == pytest.approx(ram, abs=1e6)
    free_disk = psutil.disk_usage(data_dir).free
    assert capacity["disk"] + kept["disk"] == pytest.approx(free_disk, abs=2e9)
    assert kept["disk"] == pytest.approx(max(GIB, 0.05 * (capacity["disk"] + kept["disk"])), rel=1e-3)
    assert data["kept_free"]["rule"].startswith("default headroom")
    human = cli("plan", "--model", MODEL, "--hardware", "auto")
    assert human.returncode == 0, human.stderr
    assert "kept free" in human.stdout and "RAM" in human.stdout.split("kept free", 1)[1]


def test_reserve_gb_replaces_the_rule_and_must_leave_memory(cli):
    result = cli("plan", "--model", MODEL, "--hardware", "rtx-3090", "--reserve-gb", "1", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kept_free"] == {"bytes": {"gpu": 1_000_000_000, "cpu": 1_000_000_000, "disk": 0},
                                 "rule": "--reserve-gb"}
    gpu = get_hardware("rtx-3090").gpus[0].memory_bytes
    assert data["capacity_bytes"]["gpu"] == gpu - 1_000_000_000
    refused = cli("plan", "--model", MODEL, "--hardware", "auto", "--reserve-gb", "1000")
    assert refused.returncode == 2 and refused.stdout == ""
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "--reserve-gb 1000" in refused.stderr and "GB of RAM" in refused.stderr


def test_a_model_that_fills_ram_does_not_fit_with_the_headroom(tmp_path, cli):
    """A machine whose RAM holds the model with nothing to spare: without headroom it 'runs locally'."""
    machine = hardware_to_json(get_hardware("cpu-generic"))
    # cpu-generic has no 16-bit math, so TinyLlama runs in fp32 (policy.candidate_formats) and peaks at 6.1 GB;
    # 2 GiB must stay free
    machine["cpu"]["ram_gb"] = 6.5
    machine["disk"]["capacity_gb"] = 0.5
    path = tmp_path / "small.json"
    path.write_text(json.dumps(machine))
    tight = json.loads(cli("plan", "--model", MODEL, "--hardware", str(path), "--quant", "none", "--json").stdout)
    loose = json.loads(cli("plan", "--model", MODEL, "--hardware", str(path), "--quant", "none", "--reserve-gb", "0",
                            "--json").stdout)
    assert loose["fit"] == "local" and tight["fit"] != "local"


def test_the_rule_by_hand():
    gpu_machine = get_hardware("rtx-3090")
    reserve = default_headroom(gpu_machine)
    assert reserve["gpu"] == pytest.approx(max(0.5 * GIB, 0.05 * gpu_machine.gpus[0].memory_bytes))
    assert reserve["cpu"] == pytest.approx(max(2 * GIB, 0.10 * gpu_machine.cpu.memory_bytes))
    assert tier_headroom("cpu", 8 * GIB, 3 * GIB) == pytest.approx(5 * GIB)
    assert tier_headroom("cpu", 4 * GIB, 3 * GIB) == 4 * GIB  # never more than the tier
    assert tier_headroom("cpu", 100 * GIB) == pytest.approx(10 * GIB)
    assert set(HEADROOM_RULE) == {"cpu", "gpu", "disk"}
