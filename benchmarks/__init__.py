"""Bandwidth benchmarks of the permutation ops against copy baselines and the xla backend.

Entry points: ``python3 -m benchmarks.run`` (one sweep; GPU or CPU smoke) and
``benchmarks/run_gpu_suite.sh`` (GPU tests, stress, memcheck, then the benchmark).
"""
