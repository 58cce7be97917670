"""Kernels and their pure-PyTorch references, one module per SSM family."""
