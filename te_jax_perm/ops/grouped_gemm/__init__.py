"""The grouped GEMM op: ``api`` (``grouped_matmul``, its one VJP and the selector of each
backend's GEMMs), ``decl`` (its kernels), ``reference`` (the pure-JAX GEMMs
every non-kernel path runs, and ``grouped_matmul_reference``)."""
