"""ddtree-rtc: DDTree speculative decoding for Kimi K2.6-class MoE models.

Hot kernels are raw CUDA in ``ddtree_rtc/cuda_src/`` (shipped in the wheel), compiled at load
time by NVRTC for the GPU found, driven through CuPy. Every kernel has a numpy reference with the
same signature, so the whole engine also runs (slowly) on a machine without a GPU.
"""

__version__ = "0.1.0"
