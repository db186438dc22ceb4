"""The GPU kernels, in Triton (tested on the CPU in Triton's interpreter), each with its PyTorch twin."""
