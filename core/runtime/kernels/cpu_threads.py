"""How many CPU threads the kernels may use: the physical cores, and what numpy's BLAS is told to use.

Both the BLAS path (cpu_matmul.py) and the native kernels' thread pool (native_kernels.py) size themselves from these,
so they sit below both: no torch, no numpy, only the environment and psutil.
"""

from __future__ import annotations

import os


def physical_cores() -> int:
    """The machine's physical cores (logical CPUs where psutil cannot tell)."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def blas_threads() -> int:
    """Threads numpy's BLAS uses (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, or every logical CPU by default)."""
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return os.cpu_count() or 1
