"""Quantized weights.

- `bnb`    int8 / nf4 Linear layers through bitsandbytes (CUDA's path; slow on a CPU).
- `blocks` GGUF's block formats (Q8_0, Q4_0, Q4_1) as the native kernels read them: quantized from fp32 weights,
           or a GGUF file's tensor bytes taken as they are.
- `store`  a disk store of quantized blocks, quantized once, that the offload engine streams from.
"""
