"""The fused MoE expert op: ``api`` (``moe_ffn`` and its VJP), ``decl`` (its gathered and
weighted expert GEMMs), ``reference`` (their pure-JAX references, the activations, and
``moe_ffn_reference``)."""
