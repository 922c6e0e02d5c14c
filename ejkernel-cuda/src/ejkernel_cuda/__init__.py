"""ejkernel-cuda: cuDNN fused attention through XLA and CUDA C++ kernels over the XLA FFI."""

__version__ = "1.0.0"
