"""Attention over the paged KV cache: the flat batch's metadata, the PyTorch backend (CPU, with the C++ decode
kernel), the Triton backend (GPU) and the choice between them."""
