"""Varying manual axes: the type ``jax.shard_map`` (with its default ``check_vma=True``) gives
each value inside its body, naming the mesh axes along which the value may differ from
device to device.

A kernel's results vary along every axis any of its operands varies along, and JAX's
rules for its own operations say so; a primitive of ours has to say it itself
(:func:`vary_like`). In a custom VJP, each cotangent must have its primal input's type:
where the primal was the same on every device (replicated weights) and its cotangent
differs from device to device, the true cotangent is their sum over those axes, as JAX's
own transpose of an implicit broadcast gives; where the primal varies and the cotangent
does not, the cotangent is cast (:func:`like_primal`). Lowerings see no varying axes
(:func:`plain_avals`). Outside ``shard_map``, or with
``check_vma=False``, no value varies along any axis and all of this does nothing.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax


def varying_axes(x: Any) -> frozenset:
    """The mesh axes ``x`` varies along inside ``jax.shard_map`` (empty elsewhere)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)      # jax 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))         # later releases


def _vary(x: jax.Array, axes: frozenset) -> jax.Array:
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_like(outs: Sequence[jax.Array], operands: Sequence[Any]) -> tuple[jax.Array, ...]:
    """``outs`` typed as varying along every axis some operand varies along."""
    axes = frozenset().union(*(varying_axes(o) for o in operands))
    return tuple(_vary(o, axes) for o in outs) if axes else tuple(outs)


def witness(x: jax.Array | None) -> jax.Array | None:
    """A zero-size array of ``x``'s type, kept as a custom VJP residual so that its backward
    can give the cotangent ``x``'s type (:func:`like_primal`) at no memory cost."""
    return None if x is None else x.reshape(-1)[:0]


def like_primal(ct: jax.Array | None, primal: jax.Array | None) -> jax.Array | None:
    """``ct`` with ``primal``'s varying axes: summed over the axes only ``ct`` varies along
    (the primal was the same on every device there, so each device's use of it adds to its
    gradient), cast along those only ``primal`` varies along. ``primal`` may be its
    :func:`witness`."""
    if ct is None or primal is None:
        return ct
    want, have = varying_axes(primal), varying_axes(ct)
    if extra := tuple(sorted(have - want)):
        ct = jax.lax.psum(ct, extra)
    return _vary(ct, want)


def plain_avals(ctx: Any) -> Any:
    """A lowering context whose operand and result types name no varying axes: what a kernel
    lowers to is the same either way, and a body traced from it (a reference's loops, whose
    fresh carries vary along no axis) then needs no casts of its own."""
    plain = lambda avals: tuple(jax.core.ShapedArray(a.shape, a.dtype) for a in avals)  # noqa: E731
    return ctx.replace(avals_in=plain(ctx.avals_in), avals_out=plain(ctx.avals_out))
