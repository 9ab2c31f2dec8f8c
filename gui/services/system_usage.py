"""CPU, RAM and GPU use of this machine, sampled cheaply (psutil; NVML for NVIDIA GPUs when present)."""

from __future__ import annotations

import psutil


class SystemUsage:
    """sample() -> {"cpu": %, "ram": %, "gpu": % or None, "gpu_memory": % or None}."""

    def __init__(self):
        psutil.cpu_percent(None)  # the first call only starts the interval
        self._nvml = None
        self._handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() > 0:
                self._nvml = pynvml
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no driver, no GPU, no library: no GPU line
            self._nvml = None

    @property
    def has_gpu(self) -> bool:
        return self._nvml is not None

    def sample(self) -> dict[str, float | None]:
        result: dict[str, float | None] = {"cpu": psutil.cpu_percent(None),
                                           "ram": psutil.virtual_memory().percent, "gpu": None, "gpu_memory": None}
        if self._nvml is not None:
            try:
                rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
                memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
                result["gpu"] = float(rates.gpu)
                result["gpu_memory"] = 100.0 * memory.used / max(1, memory.total)
            except Exception:
                pass
        return result

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
