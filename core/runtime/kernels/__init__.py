"""CPU decode kernels, applied to the model from outside (runtime/model.py stays plain torch).

- `cpu_matmul`      fp32 products through numpy's BLAS; weights packed in the order a step reads them.
- `cpu_decode`      one decode step of a block in numpy.
- `native_kernels`  the C kernels in `native/`, compiled at first use and loaded with ctypes.
- `quant_kernels`   matrix-vector products with block-quantized weights (Q8_0, Q4_0, Q4_1) on those kernels.
- `cpu_threads`     how many threads they may use (physical cores, BLAS's setting), below both.
"""
