"""Hardware catalog, hardware JSON files, host overrides and GPU specs derived from driver numbers."""

from __future__ import annotations

import json

import pytest

from hivekeeper.planner.errors import InputError
from hivekeeper.planner.hardware_catalog import (
    GIB,
    cpu_peak_flops_tflops,
    derive_gpu_spec,
    get_hardware,
    gpu_ids,
    hardware_from_dict,
    hardware_ids,
    hardware_to_json,
    known_gpu_id,
    load_hardware_json,
    pcie_bandwidth,
    resolve_hardware,
    simd_level,
)

REQUIRED_IDS = ["t4", "l4", "rtx-3060-12gb", "rtx-3090", "rtx-4090", "a100-40gb", "a100-80gb", "h100-sxm", "h200",
                "apple-m2-ultra", "cpu-generic"]

# /work/shared/reference/hardware.md: memory bandwidth GB/s and dense fp16 TFLOP/s as frameworks get them
# (GeForce: fp32 accumulate), board power W.
REFERENCE = {
    "t4": (320, 65, 70), "l4": (300, 121, 72), "rtx-3060-12gb": (360, 25.4, 170), "rtx-3090": (936, 71, 350),
    "rtx-4090": (1008, 165.2, 450), "a100-40gb": (1555, 312, 400), "a100-80gb": (2039, 312, 400),
    "h100-sxm": (3350, 989.4, 700), "h200": (4800, 989.4, 700),
}


def test_catalog_has_required_ids():
    assert set(REQUIRED_IDS) <= set(hardware_ids())


@pytest.mark.parametrize("hardware_id", hardware_ids())
def test_every_machine_is_complete_and_sourced(hardware_id):
    spec = get_hardware(hardware_id)
    assert spec.id == hardware_id
    devices = [*spec.gpus, spec.cpu]
    for device in devices:
        assert device.memory_bytes > 0 and device.memory_bandwidth > 0 and device.power_watts > 0
        assert device.flops and all(value > 0 for value in device.flops.values())
        assert device.sources.keys() >= {"memory_bytes", "memory_bandwidth", "flops", "power_watts"}
        assert all(source for source in device.sources.values())
    for gpu in spec.gpus:
        assert gpu.kind == "gpu" and gpu.host_link_bandwidth > 0 and "fp16" in gpu.flops and "fp32" in gpu.flops
        assert all(gpu.sources[key].startswith(("catalog:", "estimated")) for key in gpu.sources)
    assert spec.cpu.kind == "cpu" and spec.cpu.cores >= 1 and spec.cpu.host_link_bandwidth is None
    assert spec.disk.capacity_bytes > 0 and spec.disk.read_bandwidth > 0 and spec.disk.write_bandwidth > 0
    assert spec.network.upload_bps > 0 and spec.network.download_bps > 0 and spec.network.rtt_s >= 0


@pytest.mark.parametrize("hardware_id", sorted(REFERENCE))
def test_gpu_numbers_match_reference(hardware_id):
    bandwidth_gbps, fp16_tflops, power_w = REFERENCE[hardware_id]
    gpu = get_hardware(hardware_id).accelerator
    assert gpu.memory_bandwidth == bandwidth_gbps * 1e9
    assert gpu.peak_flops("fp16") == pytest.approx(fp16_tflops * 1e12)
    assert gpu.power_watts == power_w
    # frameworks get half the GeForce fp16-accumulate rate; the catalog must not list the faster one
    if hardware_id.startswith("rtx"):
        assert gpu.flops["fp16"] == pytest.approx(2 * gpu.flops["fp32"], rel=0.01)


def test_host_links_are_80_percent_of_pcie():
    assert get_hardware("t4").accelerator.host_link_bandwidth == pytest.approx(12.6e9, rel=0.01)
    assert get_hardware("rtx-4090").accelerator.host_link_bandwidth == pytest.approx(25.2e9, rel=0.01)
    assert get_hardware("h100-sxm").accelerator.host_link_bandwidth == pytest.approx(50.4e9, rel=0.01)
    assert pcie_bandwidth(1, 1) == pytest.approx(0.8 * 0.25e9)


def test_t4_has_no_fast_bf16_and_apple_is_unified():
    t4 = get_hardware("t4").accelerator
    assert t4.peak_flops("bf16") == t4.peak_flops("fp32") < t4.peak_flops("fp16") / 5
    apple = get_hardware("apple-m2-ultra")
    assert apple.accelerator.unified_memory and apple.accelerator.memory_bytes == apple.cpu.memory_bytes == 192 * GIB
    cpu_only = get_hardware("cpu-generic")
    assert not cpu_only.has_gpu and cpu_only.accelerator is cpu_only.cpu


@pytest.mark.parametrize("hardware_id", hardware_ids())
def test_json_round_trip_is_exact(hardware_id, tmp_path):
    spec = get_hardware(hardware_id, ram_gb=123.456, rtt_ms=12.5, price_per_hour=0.5)
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(hardware_to_json(spec)))
    assert load_hardware_json(path) == spec


def test_overrides_build_flexgen_machine():
    built = get_hardware("t4", ram_gb=208, disk_gb=1500, disk_read_gbps=0.72)
    flexgen = get_hardware("t4-flexgen")
    assert built.accelerator == flexgen.accelerator
    assert built.cpu.memory_bytes == flexgen.cpu.memory_bytes == 208_000_000_000
    assert built.disk.capacity_bytes == flexgen.disk.capacity_bytes == 1_500_000_000_000
    assert built.disk.read_bandwidth == flexgen.disk.read_bandwidth == 0.72e9
    assert built.cpu.sources["memory_bytes"] == built.disk.sources["capacity_bytes"] == "user"
    assert get_hardware("t4").cpu.memory_bytes != built.cpu.memory_bytes  # the default host is untouched


def test_network_price_and_unified_ram_overrides():
    spec = get_hardware("apple-m2-ultra", ram_gb=64, network_mbps=250, rtt_ms=80, price_per_hour=1.25)
    assert spec.cpu.memory_bytes == spec.accelerator.memory_bytes == 64e9
    assert spec.network.upload_bps == spec.network.download_bps == 250e6
    assert spec.network.rtt_s == pytest.approx(0.080)
    assert spec.price_per_hour == 1.25
    assert "overridden" in spec.description


@pytest.mark.parametrize("overrides, field", [
    ({"ram_gb": 10_000_000}, "ram_gb"),  # 10 PB of RAM
    ({"ram_gb": -1}, "ram_gb"),
    ({"disk_read_gbps": 0}, "disk_read_gbps"),
    ({"network_mbps": float("nan")}, "network_mbps"),
    ({"rtt_ms": -5}, "rtt_ms"),
])
def test_bad_overrides_are_refused(overrides, field):
    with pytest.raises(InputError, match=f"'{field}'"):
        get_hardware("t4", **overrides)


def test_unknown_id_lists_catalog():
    with pytest.raises(InputError, match="unknown hardware 'tpu-v5'.*rtx-4090"):
        get_hardware("tpu-v5")


def _write(tmp_path, doc, name="box.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def test_json_catalog_gpu_plus_host_fields(tmp_path):
    path = _write(tmp_path, {"gpu": "rtx-4090", "ram_gb": 128, "cpu": {"cores": 24}, "price_per_hour": 0.3})
    spec = load_hardware_json(path)
    assert spec.id == "box"
    assert spec.gpus == get_hardware("rtx-4090").gpus
    assert spec.cpu.memory_bytes == 128e9 and spec.cpu.cores == 24
    assert spec.cpu.sources["cores"] == "user" and spec.cpu.sources["memory_bytes"] == "user"
    assert spec.cpu.sources["flops"].startswith("estimated")  # taken from the base host
    assert spec.disk == get_hardware("rtx-4090").disk
    assert spec.price_per_hour == 0.3


def test_json_base_with_several_gpus_and_partial_sections(tmp_path):
    doc = {"base": "cpu-generic", "gpu": "rtx-3090", "gpu_count": 2, "cpu": {"ram_gib": 96},
           "disk": {"read_gbps": 3.5}}
    spec = load_hardware_json(_write(tmp_path, doc))
    assert [g.name for g in spec.gpus] == ["NVIDIA GeForce RTX 3090"] * 2
    assert spec.cpu.memory_bytes == 96 * GIB
    assert spec.cpu.cores == get_hardware("cpu-generic").cpu.cores
    assert spec.disk.read_bandwidth == 3.5e9
    assert spec.disk.write_bandwidth == get_hardware("cpu-generic").disk.write_bandwidth


def test_json_fully_explicit_machine(tmp_path):
    doc = {
        "id": "lab",
        "gpus": [{"name": "My GPU", "memory_gib": 16, "memory_bandwidth_gbps": 716.8,
                  "flops_tflops": {"fp32": 48.7, "fp16": 97.5}, "power_w": 320, "pcie_gen": 4, "pcie_lanes": 8}],
        "cpu": {"name": "My CPU", "cores": 12, "clock_ghz": 3.5, "simd": "avx2", "ram_gb": 64,
                "ram_bandwidth_gbps": 60, "power_w": 65},
        "disk": {"capacity_gb": 2000, "read_gbps": 6.5, "write_gbps": 5},
        "network": {"upload_mbps": 40, "download_mbps": 300, "rtt_ms": 35},
    }
    spec = load_hardware_json(_write(tmp_path, doc))
    gpu = spec.accelerator
    assert (spec.id, gpu.memory_bytes, gpu.memory_bandwidth) == ("lab", 16 * GIB, 716.8e9)
    assert gpu.host_link_bandwidth == pytest.approx(12.6e9, rel=0.01)
    assert spec.cpu.flops["fp32"] == pytest.approx(12 * 3.5e9 * 32)
    assert spec.network.rtt_s == pytest.approx(0.035)
    assert gpu.sources["flops"] == "user"


def test_cpu_only_json_needs_every_section(tmp_path):
    doc = {"cpu": {"name": "c", "cores": 4, "clock_ghz": 3, "simd": "avx2", "ram_gb": 16, "ram_bandwidth_gbps": 20,
                   "power_w": 65}, "disk": {"capacity_gb": 500, "read_gbps": 1, "write_gbps": 1}}
    with pytest.raises(InputError, match="'network' is missing"):
        load_hardware_json(_write(tmp_path, doc))


@pytest.mark.parametrize("doc, field", [
    ({"base": "cpu-generic", "cpu": {"ram_gb": 1e7}}, "cpu.ram_gb"),  # 10 PB of RAM
    ({"base": "cpu-generic", "cpu": {"cores": -2}}, "cpu.cores"),
    ({"base": "cpu-generic", "cpu": {"cores": 2.5}}, "cpu.cores"),
    ({"base": "cpu-generic", "disk": {"read_gbps": "fast"}}, "disk.read_gbps"),
    ({"base": "cpu-generic", "network": {"rtt_ms": -1}}, "network.rtt_ms"),
    ({"base": "cpu-generic", "cpu": {"ram_gb": 16, "ram_gib": 16}}, "cpu.ram_gb"),
    ({"base": "cpu-generic", "cpu": {"simd": "mmx"}}, "cpu.simd"),
    ({"base": "cpu-generic", "cpu": {"ram_gbs": 16}}, "cpu.ram_gbs"),
    ({"base": "cpu-generic", "rammm": 1}, "rammm"),
    ({"base": "mainframe"}, "base"),
    ({"gpu": "voodoo2"}, "gpu"),
    ({"base": "cpu-generic", "gpus": [{"name": "x", "memory_gb": 8}]}, "gpus[0].memory_bandwidth_gbps"),
    ({"base": "cpu-generic", "gpus": [{"name": "x", "memory_gb": 8, "memory_bandwidth_gbps": 100,
                                       "flops_tflops": {"fp13": 1}, "power_w": 100, "host_link_gbps": 10}]},
     "gpus[0].flops_tflops.fp13"),
    ({"base": "cpu-generic", "gpus": [{"name": "x", "memory_gb": 8, "memory_bandwidth_gbps": 100,
                                       "flops_tflops": {"fp16": 10}, "power_w": 100}]}, "gpus[0].host_link_gbps"),
    ({"base": "cpu-generic", "gpus": "t4"}, "gpus"),
    ({"base": "cpu-generic", "price_per_hour": -3}, "price_per_hour"),
    ({"base": "cpu-generic", "gpu": "t4", "gpus": ["t4"]}, "gpu"),
    ({"base": "cpu-generic", "cpu": {"decode_streaming": {"bandwidth_fraction": 0.7}}}, "cpu.decode_streaming"),
    ({"base": "cpu-generic", "cpu": {"decode_streaming": {"bandwidth_fraction": 1.5, "small_row_reads": 3,
                                                         "matmul_start_ms": 0.1}}}, "cpu.decode_streaming.bandwidth_fraction"),
    ([1, 2], ""),
])
def test_bad_json_names_file_and_field(tmp_path, doc, field):
    path = _write(tmp_path, doc)
    with pytest.raises(InputError) as info:
        load_hardware_json(path)
    message = str(info.value)
    assert message.startswith(str(path))
    if field:
        assert f"'{field}'" in message


def test_malformed_and_missing_json_files(tmp_path):
    path = _write(tmp_path, '{"gpu": "t4",', name="broken.json")
    with pytest.raises(InputError, match=f"{path}: not valid JSON"):
        load_hardware_json(path)
    with pytest.raises(InputError, match="cannot read"):
        load_hardware_json(tmp_path / "absent.json")


def test_resolve_hardware(tmp_path):
    assert resolve_hardware("l4") == get_hardware("l4")
    path = _write(tmp_path, {"gpu": "l4"}, name="mine.json")
    spec = resolve_hardware(str(path), ram_gb=48)
    assert spec.id == "mine" and spec.cpu.memory_bytes == 48e9 and spec.gpus == get_hardware("l4").gpus
    assert resolve_hardware("t4", disk_gb=100).disk.capacity_bytes == 100e9
    with pytest.raises(InputError, match="auto"):
        resolve_hardware("auto")
    with pytest.raises(InputError, match="cannot read"):
        resolve_hardware(str(tmp_path / "nope.json"))


# ---- GPUs derived from driver numbers --------------------------------------------------------------------------------
@pytest.mark.parametrize("name, memory_gib, expected", [
    ("NVIDIA A100-SXM4-80GB", 80, "a100-80gb"),
    ("NVIDIA A100-SXM4-40GB", 40, "a100-40gb"),
    ("NVIDIA GeForce RTX 4090", 24, "rtx-4090"),
    ("Tesla T4", 15, "t4"),
    ("NVIDIA H200", 140, "h200"),
    ("NVIDIA H100 80GB HBM3", 80, "h100-sxm"),
    ("NVIDIA L4", 22, "l4"),
    ("NVIDIA GeForce RTX 3060", 12, "rtx-3060-12gb"),
    ("NVIDIA GeForce RTX 3060", 8, None),  # the 8 GB variant is a different card
    ("NVIDIA GeForce RTX 3090 Ti", 24, None),
    ("NVIDIA A100 80GB PCIe", 80, None),  # other clocks, bandwidth and power than the SXM part
    ("NVIDIA H100 PCIe", 80, None),
    ("NVIDIA L40S", 45, None),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", 16, None),
])
def test_known_gpu_names(name, memory_gib, expected):
    assert known_gpu_id(name, memory_gib * GIB) == expected


def test_known_name_maps_to_catalog_with_detected_memory():
    detected = 81_920 * 2**20 - 3 * 2**20
    gpu = derive_gpu_spec("NVIDIA A100-SXM4-80GB", detected, 108, 1410, 1593, 5120, (8, 0), 400, 4, 16)
    catalog = get_hardware("a100-80gb").accelerator
    assert gpu.memory_bytes == detected and gpu.sources["memory_bytes"] == "detected"
    assert gpu.flops == catalog.flops and gpu.memory_bandwidth == catalog.memory_bandwidth
    assert gpu.sources["flops"].startswith("catalog:")


def test_derived_a100_pcie_matches_its_datasheet():
    """A100 80GB PCIe (NVML: 108 SMs, 1410 MHz, memory 1512 MHz, 5120-bit, 300 W): datasheet 312 TF, 1935 GB/s."""
    gpu = derive_gpu_spec("NVIDIA A100 80GB PCIe", 80 * GIB, 108, 1410, 1512, 5120, "8.0", 300, 4, 16)
    assert gpu.flops["fp16"] == pytest.approx(312e12, rel=0.01)
    assert gpu.flops["fp32"] == pytest.approx(19.5e12, rel=0.01)
    assert gpu.memory_bandwidth == pytest.approx(1935e9, rel=0.01)
    assert gpu.power_watts == 300 and gpu.host_link_bandwidth == pytest.approx(25.2e9, rel=0.01)
    assert gpu.sources["flops"].startswith("derived") and gpu.sources["memory_bandwidth"].startswith("derived")


def test_derived_geforce_uses_fp32_accumulate_rate():
    """RTX 3080 (68 SMs, boost 1710 MHz, GDDR6X 9501 MHz on 320 bits): spec 59.5 TF fp16 (fp32 acc.), 760 GB/s."""
    gpu = derive_gpu_spec("NVIDIA GeForce RTX 3080", 10 * GIB, 68, 1710, 9501, 320, (8, 6), 320, 4, 16)
    assert gpu.flops["fp16"] == pytest.approx(59.5e12, rel=0.01)
    assert gpu.flops["fp32"] == pytest.approx(29.8e12, rel=0.01)
    assert gpu.memory_bandwidth == pytest.approx(760e9, rel=0.001)
    professional = derive_gpu_spec("NVIDIA A10", 24 * GIB, 72, 1695, 6251, 384, (8, 6), 150, 4, 16)
    assert professional.flops["fp16"] == pytest.approx(125e12, rel=0.01)  # A10 datasheet: 125 TF dense


def test_derived_spec_is_never_zero():
    gpu = derive_gpu_spec("Future GPU", 0, 0, 0, 0, 0, (14, 0), None, None, None)
    assert gpu.memory_bytes > 0 and gpu.memory_bandwidth > 0 and gpu.power_watts > 0
    assert gpu.host_link_bandwidth > 0 and all(value > 0 for value in gpu.flops.values())
    assert "assumed" in gpu.sources["flops"]
    assert gpu.sources["power_watts"].startswith("default") and gpu.sources["memory_bandwidth"].startswith("default")


def test_derived_spec_round_trips_through_json():
    gpu = derive_gpu_spec("NVIDIA GeForce RTX 2080 Ti", 11 * GIB, 68, 1545, 7000, 352, (7, 5), 250, 3, 16)
    spec = get_hardware("cpu-generic")
    spec = type(spec)(**{**spec.__dict__, "gpus": (gpu,)})
    assert hardware_from_dict(json.loads(json.dumps(hardware_to_json(spec))), default_id=spec.id) == spec


def test_cpu_flops_from_simd():
    plain = cpu_peak_flops_tflops(2, 2.5, "avx2")
    assert plain["fp32"] == pytest.approx(0.16)
    # no native 16-bit math: half-precision kernels convert in software and run far below the fp32 rate
    assert plain["bf16"] < plain["fp32"] / 2 and plain["fp16"] < plain["fp32"] / 2
    flags = {"avx512f", "avx2", "fma", "avx512_vnni", "avx512_bf16"}
    assert simd_level(flags) == "avx512"
    flops = cpu_peak_flops_tflops(16, 2.0, flags)
    assert flops["fp32"] == pytest.approx(16 * 2.0 * 64 / 1000)
    assert flops["bf16"] == pytest.approx(2 * flops["fp32"]) and flops["int8"] == pytest.approx(4 * flops["fp32"])
    assert simd_level({"sse2", "avx"}) == "avx" and simd_level({"asimd"}) == "neon" and simd_level(set()) == "sse"


def test_catalog_gpu_ids_are_machines():
    assert set(gpu_ids()) <= set(hardware_ids())
