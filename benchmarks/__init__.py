"""Bandwidth benchmarks of the permutation ops against copy baselines and the xla backend.

Entry points: ``python3 -m benchmarks.run`` (one sweep; GPU or CPU smoke) and
``python3 -m tests.gpu.run --steps=all`` (GPU tests, stress, memcheck, then every benchmark).
"""
