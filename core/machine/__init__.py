"""This machine, as the planner needs to see it.

- `cpu_features`    the CPU's name and feature flags (/proc/cpuinfo; HIVEKEEPER_CPU_FLAGS pins them).
- `detect`          RAM, CPU (features from /proc/cpuinfo), disk and GPUs -> a planner HardwareSpec.
- `cpu_dtype_rule`  what a 16-bit plan computes in on a CPU (flags, then a measured bf16-vs-fp32 decode step), and how
                    the planner sees it.
- `cpu_dtype`       that decision for this machine, as the engine asks it (runs_natively_on_cpu).
- `flops_words`     what each dtype's FLOP/s figure is, in words (the Hardware page's rows; one source per table).
- `measure`         micro-benchmarks: RAM and device bandwidth, matmul FLOP/s, whole decode steps (the runtime's
                    path, beyond the last-level cache; fp32, and each packed format's), bf16 vs fp32 at decode,
                    copies, disk reads, peers.
- `measurement`     one benchmark's result as saved (no torch, so reading a profile stays light).
- `profile_files`   where machine profiles live, the hardware fingerprint, reading a profile file, the lock that
                    keeps two processes from measuring the machine at once.
- `profiles`        saved machine profiles (measurements + calibration) and applying them to a spec.
- `first_measure`   the first plan for this machine measures it quickly first (plan, generate, chat, api).
- `profiling`       timing the real runtime over a grid, calibrating the planner, predicted vs measured.
- `read_again`      a measurement's decode steps and prefill passes read again where a profile's grid ran faster
                    than it predicts.
"""
