"""The CPU kernels: one C++ extension (csrc/, built on first use by extension.py) and its Python wrappers, each with
its PyTorch twin."""
