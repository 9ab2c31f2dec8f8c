"""Quantized weights.

- `bnb`    int8 / nf4 Linear layers through bitsandbytes (CUDA's path; slow on a CPU).
- `store`  a disk store of quantized blocks, quantized once, that the offload engine streams from.
"""
