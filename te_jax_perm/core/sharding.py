"""Sharding rules: how a declared kernel runs under JAX's SPMD partitioner.

A kernel's :class:`~te_jax_perm.core.declaration.Partitioning` names its outputs' axes and
the *local* axes, along which each device runs the kernel on its own shard with no data
from other shards. Every other axis is replicated: an operand sharded along one is
gathered first (that is the rule saying "replicate", not a hidden cost of ours).

Both uses are at lowering time, so ``vmap``, ``grad`` and ``jit`` see the ordinary
primitive: a plain call lowers through ``custom_partitioning`` with a Shardy rule and the
GSPMD callbacks, its per-shard function binding the kernel again on local shapes (so the
per-device module still holds our aliased custom call); a ``vmap``-ed call becomes one
``vmapped`` primitive whose leading batch axis is local. With one device, or inside a fully
manual ``shard_map``, there is no custom-partitioning call at all; nor in a ``shard_map``
manual over some mesh axes only where JAX's custom_partitioning fails (under GSPMD, or
under Shardy with every automatic axis of size 1): the kernel runs unpartitioned there,
XLA gathering its operands along the automatic axes.

The token axis of ``token_dispatch``/``token_combine`` is not a kernel-local axis (a
token's row depends on every earlier token): its rule is op-level, in
``te_jax_perm.ops.token_split``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from absl import logging
import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec


if TYPE_CHECKING:  # pragma: no cover
    from te_jax_perm.core.primitive import KernelPrimitive

BATCH_AXIS = "__vmap__"


# -- rules ----------------------------------------------------------------------------------
def spec_axes(sharding, ndim: int) -> list[Any]:
    """The mesh axes splitting each of ``ndim`` dimensions (``None``: unsplit) when
    ``sharding`` is a :class:`NamedSharding`; otherwise none."""
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return list((spec + (None,) * ndim)[:ndim])


def partitioned(kp: "KernelPrimitive", fn: Callable, out_ranks: Sequence[int], in_batched: Sequence[bool] | None):
    """``fn`` (per-device, local shapes) wrapped in custom_partitioning per ``kp``'s named axes
    (a vmapped call's batch axis leading and local)."""
    decl, part = kp.decl, kp.decl.partitioning
    ops = [tuple(o.dims) for o in decl.operands]
    if part is None:
        outs = [tuple(f"{o.name}.{i}" for i in range(r)) for o, r in zip(decl.outputs, out_ranks)]
        local: tuple[str, ...] = ()
    else:
        outs, local = [tuple(o) for o in part.outputs], tuple(part.local)
    if in_batched is not None:
        ops = [((BATCH_AXIS,) + d) if b else d for d, b in zip(ops, in_batched)]
        outs = [(BATCH_AXIS,) + d for d in outs]
        local = (BATCH_AXIS,) + local
    factors: dict[str, str] = {}   # axis name -> Shardy factor
    rule = " -> ".join(", ".join(" ".join(factors.setdefault(n, f"f{len(factors)}") for n in d) for d in side)
                       for side in (ops, outs))

    def shardings(mesh, arg_shapes, dims_list):
        chosen: dict[str, Any] = {}   # mesh axes of each local axis: the first operand's split along it
        for dims, a in zip(ops, arg_shapes):
            for n, ax in zip(dims, spec_axes(a.sharding, len(dims))):
                if n in local and ax is not None:
                    chosen.setdefault(n, ax)
        return tuple(NamedSharding(mesh, PartitionSpec(*(chosen.get(n) for n in dims))) for dims in dims_list)

    wrapped = custom_partitioning(fn)
    wrapped.def_partition(
        lambda mesh, args, result: (mesh, fn, shardings(mesh, args, outs), shardings(mesh, args, ops)),
        infer_sharding_from_operands=lambda mesh, args, result: shardings(mesh, args, outs),
        # A multi-output kernel's user shape is a tuple of ShapeDtypeStructs.
        propagate_user_sharding=lambda mesh, user: (tuple(u.sharding for u in user) if isinstance(user, tuple)
                                                    else user.sharding),
        sharding_rule=rule,
        need_replication_factors=tuple(f for n, f in factors.items() if n not in local))
    return wrapped


# -- lowering ------------------------------------------------------------------------------
def _multi_device(ctx) -> bool:
    """Whether custom_partitioning would emit a partitioner call here (mirrors its rule)."""
    from jax._src import sharding_impls
    ac = ctx.module_context.axis_context
    if isinstance(ac, sharding_impls.SPMDAxisContext):
        return set(ac.manual_axes) != set(ac.mesh.axis_names) and len(ac.mesh._flat_devices_tuple) > 1
    if isinstance(ac, sharding_impls.ShardingContext):
        return ac.device_assignment is not None and len(ac.device_assignment) > 1
    return False


def _automatic_axes(manual_axes, axis_sizes: dict) -> dict:
    """The automatic mesh axes and their sizes in a partly manual ``shard_map``; none where
    no axis, or every axis, is manual."""
    automatic = {n: size for n, size in axis_sizes.items() if n not in set(manual_axes)}
    return automatic if manual_axes else {}


def _cannot_partition(manual_axes, axis_sizes: dict) -> bool:
    automatic = _automatic_axes(manual_axes, axis_sizes)
    return bool(automatic) and (not jax.config.jax_use_shardy_partitioner
                                or all(size == 1 for size in automatic.values()))


def partly_manual_unpartitioned(ctx=None) -> bool:
    """Whether this is a ``shard_map`` manual over some mesh axes only where JAX's
    custom_partitioning fails: under GSPMD (``jax_use_shardy_partitioner`` off) it cannot
    read the operands' shardings (manual and replicated subgroups) and XLA aborts the
    process; under Shardy it fails where every automatic axis has size 1. There the ops run
    unpartitioned: correct, XLA gathering along any automatic axis of more than one device.
    At lowering with ``ctx``, else at trace time from the abstract mesh."""
    return _cannot_partition(*_manual_and_sizes(ctx))


def _manual_and_sizes(ctx) -> tuple[tuple, dict]:
    """The manual mesh axes and every mesh axis's size: at lowering with ``ctx``, else at
    trace time from the abstract mesh."""
    if ctx is None:
        mesh = jax.sharding.get_abstract_mesh()
        return tuple(mesh.manual_axes), dict(mesh.shape)
    from jax._src import sharding_impls
    ac = ctx.module_context.axis_context
    if not isinstance(ac, sharding_impls.SPMDAxisContext):
        return (), {}
    return tuple(ac.manual_axes), dict(ac.mesh.shape)


def check_host_callback_allowed(name: str, ctx) -> None:
    """Raises a ``ValueError`` naming ``name`` for a call of the ``interpret`` backend (a
    host callback) in a ``shard_map`` manual over some mesh axes only, with an automatic
    axis of more than one device, under GSPMD: there XLA's partitioner aborts the process on
    the callback (``Check failed: sharding.IsManualSubgroup()``), as JAX refuses its own
    callbacks in such a shard_map. Shardy runs it (each device on the operands gathered
    along the automatic axes). Checked at lowering, with ``ctx``: under the partitioner XLA
    will use, whatever was set when the program was traced."""
    if jax.config.jax_use_shardy_partitioner:
        return
    manual, sizes = _manual_and_sizes(ctx)
    automatic = sorted(n for n, size in _automatic_axes(manual, sizes).items() if size > 1)
    if automatic:
        raise ValueError(
            f"{name}: backend 'interpret' runs a host callback, which XLA's GSPMD partitioner "
            f"cannot place in a shard_map manual over mesh axes {sorted(manual)} only (automatic "
            f"axes {automatic} of more than one device; it aborts the process); expected a shard_map "
            "manual over every mesh axis of more than one device (axis_names), Shardy "
            "(jax_use_shardy_partitioner on), or backend 'xla'")


def lower_partitioned(kp: "KernelPrimitive", ctx, *args, in_batched: Sequence[bool] | None = None, **kw):
    """Lowers a call of ``kp.prim``, or with ``in_batched`` of ``kp.vmapped``, through
    custom_partitioning per ``kp``'s axis names; the per-shard function binds ``kp.local``
    (in a loop over a vmapped call's batch). Not for the interpret backend under a
    multi-device jit: callbacks inside a custom_partitioning per-shard module index the
    wrong executable's callback table (a JAX limitation: it crashes), so there it lowers
    unpartitioned: correct, but XLA gathers; nor in a partly manual shard_map where JAX's
    custom_partitioning fails (:func:`partly_manual_unpartitioned`)."""
    def body(*xs):
        if in_batched is None:
            return tuple(kp.local.bind(*xs, **kw))
        return _map(lambda *full: kp.local.bind(*full, **kw), xs, in_batched)

    if kw["backend"] == "interpret" and _multi_device(ctx):
        logging.warning("%s: backend 'interpret' under a multi-device jit runs unpartitioned "
                        "(operands are gathered); use shard_map, or backend 'xla'/'triton', to "
                        "keep it shard-local", kp.decl.name)
    elif not partly_manual_unpartitioned(ctx):
        body = partitioned(kp, body, [len(a.shape) - (in_batched is not None) for a in ctx.avals_out], in_batched)
    return mlir.lower_fun(lambda *xs: list(body(*xs)), multiple_results=True)(ctx, *args)


# -- vmap: one primitive for the whole batch, batch axis local --------------------------------
# ``kp.vmapped`` is a loop over the leading axis of the batched operands, lowered through
# custom_partitioning with that axis local.
def vmapped_avals(kp: "KernelPrimitive", *avals, in_batched, **kw) -> list[jax.core.ShapedArray]:
    n = next(a.shape[0] for a, b in zip(avals, in_batched) if b)
    items = [jax.core.ShapedArray(a.shape[1:], a.dtype) if b else a for a, b in zip(avals, in_batched)]
    return [jax.core.ShapedArray((n,) + tuple(o.shape), o.dtype) for o in kp.abstract_eval(*items, **kw)]


def batch(kp: "KernelPrimitive", args: Sequence[jax.Array], dims: Sequence[Any], **kw):
    """The batching rule of ``kp.prim`` (one ``kp.vmapped`` call) and of ``kp.vmapped``
    (nested vmap: a sequential loop over the outer axis, whose partitioning is not local)."""
    args = [jnp.moveaxis(a, d, 0) if d is not None else a for a, d in zip(args, dims)]
    batched = tuple(d is not None for d in dims)
    if "in_batched" in kw:
        outs = _map(lambda *full: kp.vmapped.bind(*full, **kw), args, batched)
    else:
        outs = kp.vmapped.bind(*args, in_batched=batched, **kw)
    return list(outs), [0] * len(outs)


def _map(bind: Callable, args: Sequence[Any], batched: Sequence[bool]) -> tuple:
    """``bind`` per item of the leading axis of the ``batched`` args; the others are shared by
    every item rather than broadcast, so the loop moves no more bytes than its calls."""
    def body(xs):
        items = iter(xs)
        return tuple(bind(*(next(items) if b else a for a, b in zip(args, batched))))

    return tuple(jax.lax.map(body, tuple(a for a, b in zip(args, batched) if b)))

