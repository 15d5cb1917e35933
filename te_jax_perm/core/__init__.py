"""Declaration -> primitive framework: backends, aliasing, lowering, batching."""
from te_jax_perm.core.backends import (BACKENDS, BackendUnavailableError, check_backend_name, resolve_backend,
                                       use_backend)
from te_jax_perm.core.declaration import Config, KernelDecl, Operand, Output, Partitioning
from te_jax_perm.core.launch import Call, Launch, bind_call, configure
from te_jax_perm.core.primitive import KernelPrimitive, declare

__all__ = ["BACKENDS", "BackendUnavailableError", "Call", "Config", "KernelDecl", "KernelPrimitive", "Launch",
           "Operand", "Output", "Partitioning", "bind_call", "check_backend_name", "configure", "declare",
           "resolve_backend", "use_backend"]
