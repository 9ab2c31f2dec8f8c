"""This machine, as the planner needs to see it.

- `detect`       RAM, CPU (features from /proc/cpuinfo), disk and GPUs -> a planner HardwareSpec.
- `measure`      micro-benchmarks: RAM and device bandwidth, matmul FLOP/s, copies, disk reads, peers.
- `measurement`  one benchmark's result as saved (no torch, so reading a profile stays light).
- `profiles`     saved machine profiles (measurements + calibration) and applying them to a spec.
- `profiling`    timing the real runtime over a grid, calibrating the planner, predicted vs measured.
"""
