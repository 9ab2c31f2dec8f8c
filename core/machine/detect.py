"""Detect this machine as a HardwareSpec: RAM, CPU, the data folder's disk, and GPUs (torch.cuda + NVML).

Only sizes and names are read from the system (and what other programs hold of RAM and GPU memory now, which the
planner's default headroom leaves free: planner/hardware.py default_headroom; the disk's capacity is its free space); speeds that need a benchmark (RAM and disk bandwidth) are
conservative defaults whose source says "estimated", until `hivekeeper measure` replaces them. The CPU's FLOP/s
follow its feature flags (core/machine/cpu_features.py), and its 16-bit entries what a 16-bit plan computes in here
(core/machine/cpu_dtype_rule.py). Detection never raises: without a GPU, NVML or a CUDA build of torch the result is a
CPU-only spec, and the description says why.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
from pathlib import Path

import psutil

from hivekeeper.core.machine.cpu_dtype_rule import choice_for, with_choice
from hivekeeper.core.machine.cpu_features import cpu_flags, cpu_model_name, cpuinfo_fields, last_level_cache_bytes
from hivekeeper.planner.hardware import ComputeDevice, HardwareSpec
from hivekeeper.planner.hardware_catalog import (
    GIB,
    catalog_gpu,
    clamp_to_limit,
    cpu_peak_flops_tflops,
    derive_gpu_spec,
    hardware_from_dict,
    known_gpu_id,
    simd_level,
)

# Conservative defaults (GB/s) by disk kind, for planning before `hivekeeper measure`.
DISK_DEFAULTS_GBPS = {"nvme": (2.0, 1.0), "ssd": (0.5, 0.45), "hdd": (0.15, 0.15)}
RAM_GBPS_PER_CORE, RAM_GBPS_MIN, RAM_GBPS_MAX = 5.0, 10.0, 50.0
DEFAULT_CLOCK_GHZ = 2.5
DEFAULT_NETWORK = {"upload_mbps": 20, "download_mbps": 100, "rtt_ms": 50}


def default_data_dir() -> Path:
    """Where Hivekeeper keeps models and caches (HIVEKEEPER_DATA_DIR, else the platform's user data folder)."""
    import platformdirs

    return Path(os.environ.get("HIVEKEEPER_DATA_DIR") or platformdirs.user_data_dir("hivekeeper"))


# ---- CPU ----------------------------------------------------------------------------------------------------------
def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def detect_cpu_section() -> dict:
    """The "cpu" section of a hardware document for this machine, with sources."""
    info = cpuinfo_fields()
    name = cpu_model_name() if info else (_sysctl("machdep.cpu.brand_string") or cpu_model_name())
    flags = set(cpu_flags())
    cores = psutil.cpu_count(logical=False) or psutil.cpu_count(logical=True) or 1

    sources = {"cores": "detected", "memory_bytes": "detected"}
    memory = psutil.virtual_memory()
    clock_ghz, clock_source = cpu_clock_ghz(info)
    level = simd_level(flags) if flags else "sse"
    flops = cpu_peak_flops_tflops(cores, clock_ghz, flags or level)
    sources["flops"] = f"estimated: {cores} cores x {clock_ghz:.2f} GHz ({clock_source}) x {level} FLOP/cycle"

    ram_gbps = min(max(RAM_GBPS_PER_CORE * cores, RAM_GBPS_MIN), RAM_GBPS_MAX)
    sources["memory_bandwidth"] = (f"estimated: conservative {RAM_GBPS_PER_CORE:g} GB/s per core "
                                   f"({RAM_GBPS_MIN:g}-{RAM_GBPS_MAX:g}); `hivekeeper measure` replaces it")
    sources["power_watts"] = "estimated: 10 W per core (15-300 W)"
    return {
        "name": " ".join(name.split()),
        "cores": cores,
        "ram_gb": clamp_to_limit(memory.total / 1e9, "ram_gb"),
        "in_use_gb": max(0, memory.total - memory.available) / 1e9,
        "cache_mib": clamp_to_limit(last_level_cache_bytes() / (1 << 20), "cache_mib"),
        "ram_bandwidth_gbps": ram_gbps,
        "flops_tflops": {k: clamp_to_limit(v, "tflops") for k, v in flops.items()},
        "power_w": min(max(10.0 * cores, 15.0), 300.0),
        "sources": sources,
    }


def cpu_clock_ghz(info: dict[str, str]) -> tuple[float, str]:
    """Max (else current) CPU clock: psutil, then the '@ 2.20GHz' of the model name, then cpuinfo's 'cpu MHz'."""
    try:
        freq = psutil.cpu_freq()
    except (OSError, NotImplementedError, AttributeError):
        freq = None
    if freq and freq.max and freq.max > 0:
        return freq.max / 1000, "max clock"
    match = re.search(r"@\s*([\d.]+)\s*GHz", info.get("model name", ""))
    if match:
        return float(match.group(1)), "rated clock"
    if freq and freq.current and freq.current > 0:
        return freq.current / 1000, "current clock"
    try:
        return float(info["cpu mhz"]) / 1000, "current clock"
    except (KeyError, ValueError):
        return DEFAULT_CLOCK_GHZ, "clock unknown, assumed"


# ---- disk ---------------------------------------------------------------------------------------------------------
def _existing_parent(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _disk_kind(path: Path) -> str:
    """'nvme', 'ssd' or 'hdd' for the block device holding `path` (Linux sysfs; 'ssd' when unknown)."""
    best = None
    try:
        for part in psutil.disk_partitions(all=False):
            if str(path).startswith(part.mountpoint) and (best is None or len(part.mountpoint) > len(best.mountpoint)):
                best = part
    except OSError:
        return "ssd"
    if best is None or not best.device.startswith("/dev/"):
        return "ssd"
    device = Path(best.device).resolve().name
    if device.startswith("nvme"):
        return "nvme"
    if device.startswith(("vd", "xvd")):
        return "ssd"  # virtual disks report rotational=1 whatever backs them
    sys_path = Path("/sys/class/block") / device
    for queue in (sys_path / "queue", sys_path.resolve().parent / "queue"):
        try:
            return "hdd" if (queue / "rotational").read_text().strip() == "1" else "ssd"
        except OSError:
            continue
    return "ssd"


def detect_disk_section(data_dir: Path) -> dict:
    """The "disk" section: the free space of the data folder's filesystem (what offloading can use; its size would
    count other files); bandwidth defaults by disk kind."""
    folder = _existing_parent(data_dir)
    usage = psutil.disk_usage(str(folder))
    free = max(usage.free, 1e6)  # a full disk still gives a valid spec (1 MB), on which nothing is offloaded
    kind = _disk_kind(folder)
    read, write = DISK_DEFAULTS_GBPS[kind]
    estimated = f"estimated: {kind} default; `hivekeeper measure` replaces it"
    return {
        "capacity_gb": clamp_to_limit(free / 1e9, "capacity_gb"),
        "read_gbps": read,
        "write_gbps": write,
        "sources": {"capacity_bytes": f"detected: free space of the filesystem of {folder} "
                                      f"({usage.total / 1e9:.0f} GB in all)", "read_bandwidth": estimated,
                    "write_bandwidth": estimated},
    }


# ---- GPUs ---------------------------------------------------------------------------------------------------------
def nvml_devices() -> dict[str, dict]:
    """NVML's numbers per GPU UUID (without the 'GPU-' prefix); empty when NVML is missing or fails."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no permission: all mean "no NVML numbers"
        return {}
    devices = {}
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid

            def ask(function, *args, scale=1.0):
                try:
                    return getattr(pynvml, function)(handle, *args) * scale
                except Exception:
                    return None

            devices[uuid.removeprefix("GPU-")] = {
                "index": index,
                "sm_clock_mhz": ask("nvmlDeviceGetMaxClockInfo", pynvml.NVML_CLOCK_SM),
                "mem_clock_mhz": ask("nvmlDeviceGetMaxClockInfo", pynvml.NVML_CLOCK_MEM),
                "mem_bus_width_bits": ask("nvmlDeviceGetMemoryBusWidth"),
                "power_limit_w": ask("nvmlDeviceGetPowerManagementLimit", scale=1e-3),
                "pcie_gen": ask("nvmlDeviceGetMaxPcieLinkGeneration"),
                "pcie_width": ask("nvmlDeviceGetMaxPcieLinkWidth"),
                "memory_used": nvml_memory_used(pynvml, handle),
            }
    except Exception:
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return devices


def nvml_memory_used(pynvml, handle) -> int | None:
    """Bytes of a GPU's memory that processes hold now (NVML), None when NVML cannot say."""
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:
        return None


def detect_cuda_gpus() -> tuple[list[ComputeDevice], str]:
    """GPUs torch can use, with NVML's clocks where available; a note says why there are none."""
    try:
        import torch
    except Exception as exc:  # a broken torch install must not break detection
        return [], f"torch unavailable ({type(exc).__name__})"
    if not torch.cuda.is_available():
        if torch.backends.mps.is_available():
            return [_apple_gpu()], ""
        cuda_build = torch.version.cuda is not None
        return [], "no CUDA device" if cuda_build else "torch has no CUDA build"
    nvml = nvml_devices()
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        uuid = str(getattr(props, "uuid", "")).removeprefix("GPU-")
        extra = nvml.get(uuid) or next((d for d in nvml.values() if d["index"] == index), {}) if nvml else {}
        gpus.append(derive_gpu_spec(
            name=props.name,
            memory_bytes=int(props.total_memory),
            sm_count=int(props.multi_processor_count),
            sm_clock_mhz=extra.get("sm_clock_mhz"),
            mem_clock_mhz=extra.get("mem_clock_mhz"),
            mem_bus_width_bits=extra.get("mem_bus_width_bits"),
            compute_capability=(props.major, props.minor),
            power_limit_w=extra.get("power_limit_w"),
            pcie_gen=extra.get("pcie_gen"),
            pcie_width=extra.get("pcie_width"),
        ))
        used = extra.get("memory_used")
        if used:
            gpus[-1] = dataclasses.replace(gpus[-1], in_use_bytes=min(int(used), gpus[-1].memory_bytes))
    return gpus, "" if nvml else "NVML unavailable: GPU clocks, power and PCIe link are defaults"


def _apple_gpu() -> ComputeDevice:
    """Apple silicon through torch's MPS: catalog numbers for a known chip, else rough defaults; unified memory."""
    chip = _sysctl("machdep.cpu.brand_string") or "Apple silicon"
    ram = psutil.virtual_memory().total
    catalog_id = known_gpu_id(chip)
    if catalog_id:
        gpu = catalog_gpu(catalog_id)
        return dataclasses.replace(gpu, memory_bytes=ram, sources={**gpu.sources, "memory_bytes": "detected"})
    default = "default: unknown Apple chip"
    return ComputeDevice(kind="gpu", name=chip, memory_bytes=ram, memory_bandwidth=100e9, flops={"fp32": 3e12},
                         power_watts=30.0, host_link_bandwidth=100e9, unified_memory=True,
                         sources={"memory_bytes": "detected", "memory_bandwidth": default, "flops": default,
                                  "power_watts": default, "host_link_bandwidth": default})


# ---- the machine --------------------------------------------------------------------------------------------------
def detect_hardware(data_dir: str | Path | None = None) -> HardwareSpec:
    """This machine as a HardwareSpec. Never raises for missing GPUs, NVML or CUDA: the result is then CPU-only."""
    folder = Path(data_dir) if data_dir else default_data_dir()
    network_source = "default: not measured; override with --network-mbps / --rtt-ms"
    doc = {
        "id": "detected",
        "cpu": detect_cpu_section(),
        "disk": detect_disk_section(folder),
        "network": {**DEFAULT_NETWORK, "sources": {"upload_bps": network_source, "download_bps": network_source,
                                                   "rtt_s": network_source}},
    }
    spec = hardware_from_dict(doc, where="detected hardware", default_source="detected")
    try:
        gpus, note = detect_cuda_gpus()
    except Exception as exc:  # detection must not fail because a driver misbehaves
        gpus, note = [], f"GPU detection failed ({type(exc).__name__}: {exc})"
    gpu_names = ", ".join(gpu.name for gpu in gpus) or "no GPU"
    description = f"{socket.gethostname()}: {gpu_names}; {spec.cpu.name}, {spec.cpu.memory_bytes / GIB:.1f} GiB RAM"
    if note:
        description += f" ({note})"
    spec = dataclasses.replace(spec, gpus=tuple(gpus), description=description)
    # what a 16-bit plan computes in here (flags and the saved measurement), as the planner must cost it
    return dataclasses.replace(spec, cpu=with_choice(spec.cpu, choice_for(spec)))
