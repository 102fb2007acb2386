"""Triton kernels for the CUDA decode path; imported only when a tensor is on CUDA."""
