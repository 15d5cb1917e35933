"""The public ops, one package per op, each holding the same files: ``api.py`` (the public
functions with their custom VJPs), ``decl.py`` (the kernel declarations) and ``reference.py``
(the pure-JAX references, the kernels' ``xla`` backend). The ops: ``row_id_map``,
``permute`` (with ``token_dispatch`` / ``token_combine``), ``chunk_sort``, ``grouped_gemm``,
``moe_ffn``.
The Triton kernels they declare are in :mod:`te_jax_perm.kernels`; the modules beside the
packages are helpers the ops share."""
from __future__ import annotations

from typing import Any


def shipped_decls() -> dict[str, Any]:
    """Kernel name -> declaration of every kernel primitive the ops define, so that
    ``python -m te_jax_perm.autotune --print_cache`` checks each entry's configs against
    its kernel's declaration."""
    import importlib
    import pkgutil

    from te_jax_perm.core import KernelPrimitive
    found = {}
    for mod in pkgutil.walk_packages(__path__, __name__ + "."):
        for v in vars(importlib.import_module(mod.name)).values():
            if isinstance(v, KernelPrimitive):
                found[v.decl.name] = v.decl
    return found
