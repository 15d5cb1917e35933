"""The permute op: ``api`` (``permute_with_mask_map``, ``unpermute_with_mask_map`` and the
TransformerEngine-compatible ``token_dispatch`` / ``token_combine``, with their VJPs),
``decl`` (the row movers' kernels), ``reference`` (their pure-JAX references)."""
