"""Correctness cases for the Triton kernels, run under Triton's interpreter (tests/unit/test_kernels.py) or on
a GPU (`python -m tests.kernels.cases --device cuda`, used by tests/bench/gpu_kernels.sh)."""
