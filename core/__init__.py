"""Hivekeeper's core: what runs. Imports flow gui -> core -> planner, never back.

Map:
- `machine/`  this machine: detection, CPU features, micro-benchmarks, saved profiles, runtime profiling.
- `runtime/`  a model: blocks, checkpoint formats, tokenizer, sampling, generation, chat history, demo models;
              `runtime/kernels/` the CPU decode kernels, `runtime/quant/` quantized weights.
- `offload/`  running a model that does not fit: placement by tier, streaming, tiered KV caches, local plans.
- `swarm/`    the Petals-compatible swarm: wire protocol, DHT records, local swarms; `server/` and `client/`.
- `api/`      the local OpenAI-compatible HTTP API (`hivekeeper api`).
- `finetune/` training soft and deep prompts for a frozen model, locally or through the swarm; using them.
- `cli/`      the `hivekeeper` command: one module per subcommand.
- `atomic_file`, `child_argv`: writing files whole, and command lines of our own child processes.
- `version`    Hivekeeper's version (pyproject's, via the package metadata), torch's, hivemind's, Python's; APP_ID.
"""

import os

# numpy's OpenBLAS (which multiplies prefill batches) keeps its idle threads spinning for 2^28 cycles (~0.1 s) after
# every call. On a machine with few cores they take the CPU from the decode kernels' threads
# (runtime/kernels/native_kernels.py): the first decode steps after a prefill ran up to 2x slower. 2^20 cycles
# (~0.4 ms) still covers the gaps between a prefill's products. OpenBLAS reads it when numpy loads it, and torch
# imports numpy: so it is set here, before either.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")
