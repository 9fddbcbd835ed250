"""Platforms: which accelerator (CUDA, ROCm, Intel XPU) or CPU this engine runs on, and its defaults."""
