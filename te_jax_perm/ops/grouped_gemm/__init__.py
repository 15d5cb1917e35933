"""The grouped GEMM op: ``api`` (``grouped_matmul``, ``grouped_gemm_triton``, their one
VJP and implementation selector), ``decl`` (its kernels), ``reference`` (the pure-JAX GEMMs
every non-kernel path runs, and ``grouped_matmul_reference``)."""
