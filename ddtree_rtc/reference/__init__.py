"""Numpy references of every kernel, same signatures as ``ddtree_rtc.kernels``; fp32/fp64 math.
bf16 arrays are ``ml_dtypes.bfloat16`` here (uint16 bits on the GPU)."""
