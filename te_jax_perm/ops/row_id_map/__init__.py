"""The row-id map op: ``api`` (``make_row_id_map``), ``decl`` (its kernels), ``reference``
(``row_id_map_reference``, the kernels' pure-JAX/NumPy references)."""
