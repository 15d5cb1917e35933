"""Public ops: row-id map, permute/unpermute, TE-compatible dispatch/combine, chunk sort."""
