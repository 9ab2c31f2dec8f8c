"""Hivekeeper's core: detection and measurement, the model runtime, the offloading engine, the swarm, the CLI."""

import os

# numpy's OpenBLAS (which multiplies prefill batches) keeps its idle threads spinning for 2^28 cycles (~0.1 s) after
# every call. On a machine with few cores they take the CPU from the decode kernels' threads (core/native_kernels.py):
# the first decode steps after a prefill ran up to 2x slower. 2^20 cycles (~0.4 ms) still covers the gaps between a
# prefill's products. OpenBLAS reads it when numpy loads it, and torch imports numpy: so it is set here, before either.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")
