"""The public ops, one package per op, each holding the same files: ``api.py`` (the public
functions with their custom VJPs), ``decl.py`` (the kernel declarations) and ``reference.py``
(the pure-JAX references, the kernels' ``xla`` backend). The ops: ``row_id_map``,
``permute`` (with ``token_dispatch`` / ``token_combine``), ``chunk_sort``, ``grouped_gemm``.
The Triton kernels they declare are in :mod:`te_jax_perm.kernels`; the modules beside the
packages are helpers the ops share."""
