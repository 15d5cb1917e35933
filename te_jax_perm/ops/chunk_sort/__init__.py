"""The chunk sort op: ``api`` (``sort_chunks_by_index`` and friends, with their VJP),
``decl`` (its kernels), ``reference`` (``sort_chunks_reference`` and the kernels'
references)."""
