"""Declaration -> JAX primitive: abstract eval, per-platform lowering, batching.

Every lowering path except ``xla`` emits one custom call whose outputs are preallocated
operands with declared ``input_output_aliases`` (see :mod:`te_jax_perm.core.aliasing`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.extend  # noqa: F401  (jax.extend is not imported by `import jax`)
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax._src import dispatch
from jax.interpreters import batching, mlir

from te_jax_perm.core import backends, checks, sharding
from te_jax_perm.core.declaration import Config, KernelDecl
from te_jax_perm.core.launch import bind_call, check_operands, configure, select_config
from te_jax_perm.core.manual_axes import plain_avals, vary_like

_RESERVED = ("backend", "config")


def _jit_bind(prim: Primitive, kw_items) -> Callable:
    return jax.jit(functools.partial(prim.bind, **dict(kw_items)))


# Eager calls' jitted binds, one per primitive and parameter set, so eager calls reuse
# compiled executables: the kernel backends' apart from the xla backend's, which choose no
# config and so outlive forget_eager_executables.
_kernel_binds = functools.lru_cache(maxsize=256)(_jit_bind)
_xla_binds = functools.lru_cache(maxsize=256)(_jit_bind)


class KernelPrimitive:
    """A declared kernel bound to a JAX primitive. Call it like a function."""

    def __init__(self, decl: KernelDecl):
        if clash := set(decl.params) & set(_RESERVED):
            raise ValueError(f"{decl.name}: parameter names {sorted(clash)} are reserved")
        self.decl = decl
        # Sharding (core/sharding.py): `prim` lowers through custom_partitioning, whose
        # per-shard function binds `local` (same kernel, lowered directly). vmap binds
        # `vmapped`, one sequential loop over the batch whose batch axis shards with no
        # collectives: correct for every kernel, and unbatched operands are shared, not
        # broadcast, so it moves no more bytes than the loop it replaces.
        partitioned = lambda platform, *a, **kw: sharding.lower_partitioned(self, *a, **kw)  # noqa: E731
        self.prim = self._primitive("", self.abstract_eval, partitioned)
        self.local = self._primitive("_local", self.abstract_eval, self._lower_local)
        self.vmapped = self._primitive("_vmapped", functools.partial(sharding.vmapped_avals, self), partitioned)
        for prim in (self.prim, self.vmapped):
            batching.primitive_batchers[prim] = functools.partial(sharding.batch, self)
            # custom_partitioning needs the device assignment at lowering time; so do we,
            # since we emit it from our own lowering rule.
            dispatch.prim_requires_devices_during_lowering.add(prim)

    def _primitive(self, suffix: str, abstract_eval: Callable, lower: Callable) -> Primitive:
        """One of the kernel's primitives; ``lower(platform, ctx, *args, **params)``."""
        prim = Primitive(f"te_jax_perm_{self.decl.name}{suffix}")
        prim.multiple_results = True
        prim.def_abstract_eval(abstract_eval)
        prim.def_impl(functools.partial(self._impl, prim))
        for platform in ("cpu", "cuda", "rocm"):
            mlir.register_lowering(prim, functools.partial(lower, platform), platform=platform)
        return prim

    # -- user entry point -------------------------------------------------------------
    def __call__(self, *operands: jax.Array, backend: str | None = None, config: Config | None = None,
                 **params: Any) -> tuple[jax.Array, ...]:
        decl = self.decl
        given = operands
        check_operands(decl, operands)
        operands = tuple(jnp.asarray(o) for o in operands)
        chosen = backends.resolve_backend(backend)
        call = bind_call(decl, [o.aval for o in operands], params, chosen)
        if decl.validate is not None:
            # Values are checked as given: under jit, jnp.asarray makes a NumPy constant a
            # tracer, whose values would be checked only in the checked mode.
            shown = tuple(g if isinstance(g, np.ndarray) else o for g, o in zip(given, operands))
            checks.check_values(functools.partial(_validation_problem, decl, call.dims, params), *shown)
        # Inside jax.shard_map, the results vary along the operands' varying axes.
        return vary_like(self.prim.bind(*operands, backend=chosen, config=config, **params), operands)

    # -- primitive rules --------------------------------------------------------------
    def abstract_eval(self, *avals, backend: str, config: Config | None, **params):   # a config sets no shape
        return list(bind_call(self.decl, avals, params, backend).out_avals)

    def _impl(self, prim: Primitive, *args, **kw):
        run = (_xla_binds if kw["backend"] == "xla" else _kernel_binds)(prim, tuple(sorted(kw.items())))
        if kw["backend"] != "interpret":
            return run(*args)
        from te_jax_perm.core.interpret_backend import run_eagerly
        return run_eagerly(run, args)

    @staticmethod
    def forget_eager_executables() -> None:
        """Makes the next eager (un-jitted) call of every kernel on a kernel backend lower
        again. A kernel's config is chosen when it lowers, so a config resolver installed
        since (the tuner, a sweep over configs) is then consulted; nothing else JAX compiled
        is dropped (the ``xla`` backend's calls, which choose no config, are kept)."""
        _kernel_binds.cache_clear()

    def _lower_local(self, platform: str, ctx, *args, backend: str, config: Config | None, **params):
        decl = self.decl
        ctx = plain_avals(ctx)
        if backend == "xla":
            return mlir.lower_fun(lambda *ops: decl.run_reference(ops, params, ctx.avals_out),
                                  multiple_results=True)(ctx, *args)
        fn = self._backend_fn(platform, backend)
        if backend == "interpret":
            # At lowering, under the partitioner XLA will use (a program traced under Shardy
            # may be lowered under GSPMD).
            sharding.check_host_callback_allowed(decl.name, ctx)
        # The launch is built here, once, and handed down: the backend derives nothing.
        call = bind_call(decl, ctx.avals_in, params, backend)
        launch = configure(call, select_config(call, config))
        return mlir.lower_fun(lambda *ops: fn(launch, ops), multiple_results=True)(ctx, *args)

    def _backend_fn(self, platform: str, backend: str) -> Callable:
        if backend == "interpret":
            if platform != "cpu":
                raise backends.BackendUnavailableError(
                    f"{self.decl.name}: backend 'interpret' lowers for the CPU platform only, not {platform!r}; "
                    "call the op outside jit (eager calls run on the CPU), or jit it under "
                    "jax.default_device(jax.devices('cpu')[0]) (te_jax_perm.sanitize.sanitize() scopes do this)")
            if not self.decl.interpretable:
                raise backends.BackendUnavailableError(
                    f"{self.decl.name}: backend 'interpret' cannot run this kernel (Triton's interpreter "
                    "runs no Gluon kernel); use backend 'triton' on a GPU, or 'xla'")
            from te_jax_perm.core.interpret_backend import interpret_call
            return interpret_call
        # Backend 'triton': the only other name resolve_backend lets through to a lowering.
        if platform not in ("cuda", "rocm"):
            raise backends.BackendUnavailableError(
                f"{self.decl.name}: backend 'triton' needs a GPU platform; this computation is placed "
                f"on {platform!r}. Use backend='interpret' or 'xla' on CPU.")
        from te_jax_perm.core.triton_backend import triton_call
        return triton_call


def _validation_problem(decl: KernelDecl, dims, params, *operands) -> str | None:
    try:
        decl.validate(operands, dims, params)
    except ValueError as e:
        return str(e)
    return None


def declare(decl: KernelDecl) -> KernelPrimitive:
    """Turns a declaration into a callable JAX primitive: ``op(*operands, backend=None,
    config=None, **params)`` returns a tuple, one array per output, and works under ``jit``
    and ``vmap`` (one launch per batch item). It has no gradient rule: give the public
    function a ``jax.custom_vjp`` (docs/kernels.md walks through a whole kernel)."""
    return KernelPrimitive(decl)
