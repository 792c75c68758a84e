"""GPU tests (marked ``gpu``; skipped where CuPy sees no CUDA device). Run with bench/gpu_check.sh."""
