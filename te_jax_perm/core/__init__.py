"""Declaration -> primitive framework: backends, aliasing, lowering, batching."""
from te_jax_perm.core.backends import BACKENDS, BackendUnavailableError, resolve_backend, use_backend
from te_jax_perm.core.declaration import Config, KernelDecl, Operand, Output
from te_jax_perm.core.primitive import KernelPrimitive, declare

__all__ = ["BACKENDS", "BackendUnavailableError", "Config", "KernelDecl", "KernelPrimitive", "Operand",
           "Output", "declare", "resolve_backend", "use_backend"]
