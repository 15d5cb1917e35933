"""Benchmarks of the permutation ops, the grouped GEMM and the MoE layer (BUILD.md lists them).

Entry points: ``python3 -m benchmarks.peer`` (every op against the ``xla`` backend, a device
copy and TransformerEngine's kernels), ``python3 -m benchmarks.layer_bench`` (the MoE layer)
and ``python3 -m tests.gpu.run --steps=all`` (GPU tests, stress, memcheck, then every benchmark).
"""
