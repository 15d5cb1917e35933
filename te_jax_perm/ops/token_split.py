"""The ops' token-axis sharding rule: a rule with no kernel, so a module, not an op package.

A token-sharded dispatch or combine runs as independent local calls.

Data- and FSDP-parallel meshes shard tokens. Routing is data-dependent (a token's row
depends on every earlier token), so there is no sharding of one global dispatch that
needs no communication; instead, as TransformerEngine does, each shard dispatches its own
tokens: shard ``i`` of ``S`` builds the row-id map of its ``T/S`` tokens and fills its
``R/S`` rows of the output, where ``R`` is the output's global row count (so
``num_out_tokens`` is divided across the shards). Outputs stay sharded the same way,
and the matching combine (and both backward passes) run locally too: no collectives.

Axis names: ``"T"`` (tokens) and ``"R"`` (expert-sorted rows) are split together along
the mesh axes that shard the tokens; ``"H"`` is local (sliced along whatever shards it, as
every row mover is; an op whose shard-local result sums over the hidden elements, as the
combine's merging-probability gradient does, names its hidden axis otherwise); any other
axis is replicated. A per-shard partial sum (a weight's
gradient) is summed over the token shards; where the operand it follows (the weight)
arrives split along a dimension by token mesh axes alone, as FSDP splits weights, the sum
is reduce-scattered along that dimension over those axes (half an all-reduce's bytes on
the wire) and comes out split like the operand. ``T`` and ``R`` must be divisible by
the number of token shards: otherwise compiling the program raises a ``ValueError`` that
names the op, the size and the shard count (not XLA's own error; see
:func:`te_jax_perm.core.errors.keep`).

Mechanics: :func:`jax.experimental.custom_partitioning` with a Shardy rule in which ``T``
and ``R`` share one factor (of size ``gcd(T, R)``), so propagation shards ``R`` exactly
like ``T``; the per-shard function reads its shard's size off its operands. With one
device, or inside a fully manual ``shard_map``, the call is the per-shard function on the whole operands. Under
``vmap`` the call is partitioned the same way with the batch as one more leading axis,
local as ``H`` is, and the per-shard function maps over its shard's batch items: each item
runs per token shard as an unbatched call does. The ``interpret`` backend runs kernels in
host callbacks, which cannot live in a partitioned module (a JAX limitation), so with it a
multi-device program computes the unsharded (global) result instead; so does a call inside
a ``shard_map`` manual over some mesh axes only where JAX's custom_partitioning fails (under
GSPMD, where it aborts the process, or under Shardy with every automatic axis of size 1):
each manual shard dispatches all of its tokens, gathered along any automatic axis.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.custom_batching import custom_vmap
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.experimental.custom_partitioning import CompoundFactor, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from te_jax_perm.core import errors
from te_jax_perm.core.manual_axes import vary_like
from te_jax_perm.core.sharding import partly_manual_unpartitioned, spec_axes
from te_jax_perm._checks import first_order

SPLIT = ("T", "R")
LOCAL = "H"

Axes = Sequence[str]


def dim_splits(mesh, sharding, ndim: int) -> list[tuple[Any, int]]:
    """Per dimension of an operand: ``(PartitionSpec entry splitting it or None, pieces)``.
    Where no PartitionSpec can name the split (Shardy splits a dimension a mesh axis does
    not divide along part of it), the entry is ``None`` and ``pieces`` still counts it."""
    if isinstance(sharding, NamedSharding):
        return [(ax, _axes_size(mesh, ax)) for ax in spec_axes(sharding, ndim)]
    try:
        hlo = sharding._to_xla_hlo_sharding(ndim)
    except Exception:  # noqa: BLE001 - no HLO form (a single-device sharding): unsplit
        return [(None, 1)] * ndim
    if not hlo.is_tiled():
        return [(None, 1)] * ndim
    pieces = [int(p) for p in hlo.tile_assignment_dimensions()[:ndim]]
    from jax._src import sharding_impls
    try:
        spec = tuple(sharding_impls.parse_flatten_op_sharding(hlo, mesh)[0])
    except (ValueError, NotImplementedError, KeyError):
        # IndivisibleError is a ValueError; a KeyError comes from a mesh that is manual along
        # some axes (a partly manual shard_map), whose devices the split does not name.
        return [(None, p) for p in pieces]
    spec = (spec + (None,) * ndim)[:ndim]
    return [(_entry(ax), p) for ax, p in zip(spec, pieces)]


def _entry(ax):
    """A PartitionSpec entry in its plain form: None, one axis name, or a tuple of several."""
    if isinstance(ax, (tuple, list)):
        return None if not ax else ax[0] if len(ax) == 1 else tuple(ax)
    return ax


def _axes_size(mesh, ax) -> int:
    return int(math.prod(mesh.shape[a] for a in _axis_names(ax)))


def _split(mesh, arg_shapes, arg_axes: Sequence[Axes], name_set) -> tuple[object, int]:
    """``(mesh axes, pieces)`` of the first operand axis named in ``name_set`` that is split
    (``(None, 1)``: none is; mesh axes ``None`` with pieces > 1: split along part of an axis)."""
    for shape, axes in zip(arg_shapes, arg_axes):
        for n, (ax, pieces) in zip(axes, dim_splits(mesh, shape.sharding, len(axes))):
            if n in name_set and pieces > 1:
                return ax, pieces
    return None, 1


def _axis_names(ax) -> tuple[str, ...]:
    """The mesh axis names of a PartitionSpec entry (none for ``None``)."""
    return () if ax is None else tuple(ax) if isinstance(ax, (tuple, list)) else (ax,)


def _scatter_plan(mesh, operand, tokens) -> tuple[tuple[int, Any], ...]:
    """``(dimension, mesh axes)`` pairs along which a partial sum shaped like ``operand``
    is reduce-scattered: each dimension ``operand`` arrives split along by token mesh axes
    alone, evenly, each axis in one dimension only. Summed over those axes in this way, the
    sum lands split as ``operand`` is; the other token axes are summed whole."""
    tok, used, plan = set(_axis_names(tokens)), set(), []
    for d, (ax, pieces) in enumerate(dim_splits(mesh, operand.sharding, len(operand.shape))):
        names = set(_axis_names(ax))
        if pieces > 1 and names and names <= tok and not names & used and operand.shape[d] % pieces == 0:
            plan.append((d, ax))
            used |= names
    return tuple(plan)


def _out_shardings(mesh, out_axes: Sequence[Axes], tokens, local: dict[str, Any],
                   plans: dict[int, tuple[tuple[int, Any], ...]]) -> list[NamedSharding]:
    """The outputs' shardings: :func:`_shardings`, each reduce-scattered output split as its
    plan says (and along its vmapped batch axes as they are, which the sum does not cross)."""
    out = _shardings(mesh, out_axes, tokens, local)
    for i, plan in plans.items():
        spec = [local.get(n) if n != LOCAL else None for n in out_axes[i]]
        for d, ax in plan:
            spec[d] = ax
        out[i] = NamedSharding(mesh, PartitionSpec(*spec))
    return out


def _sum_over_tokens(x: jax.Array, tokens, plan: tuple[tuple[int, Any], ...]) -> jax.Array:
    """``x`` summed over the token shards: reduce-scattered along ``plan``'s dimensions, then
    all-reduced over the token axes no dimension took."""
    for d, ax in plan:
        x = jax.lax.psum_scatter(x, ax, scatter_dimension=d, tiled=True)
    scattered = {n for _, ax in plan for n in _axis_names(ax)}
    rest = tuple(n for n in _axis_names(tokens) if n not in scattered)
    return jax.lax.psum(x, rest) if rest else x


def _shardings(mesh, axes_list: Sequence[Axes], tokens, local: dict[str, Any]) -> list[NamedSharding]:
    pick = lambda n: tokens if n in SPLIT else local.get(n)  # noqa: E731
    return [NamedSharding(mesh, PartitionSpec(*(pick(n) for n in axes))) for axes in axes_list]


def _local_splits(mesh, arg_shapes, arg_axes: Sequence[Axes], local_names: Sequence[str], tokens) -> dict[str, Any]:
    """The mesh axes along which each local axis (``H``, vmapped batch axes) is sliced: the
    first operand's split of it, where that split shares no mesh axis with the tokens' or an
    earlier local axis's (one mesh axis cannot split two dimensions of one array); the
    others are gathered."""
    taken, chosen = set(_axis_names(tokens)), {}
    for n in local_names:
        ax = _split(mesh, arg_shapes, arg_axes, {n})[0]
        if ax is not None and not set(_axis_names(ax)) & taken:
            chosen[n] = ax
            taken |= set(_axis_names(ax))
    return chosen


def _rule(arg_axes: Sequence[Axes], out_axes: Sequence[Axes], sizes: dict[str, int],
          local_names: Sequence[str]) -> SdyShardingRule:
    """T and R as compounds (s, tx) and (s, rx) of one shared factor s = gcd(T, R)."""
    g = math.gcd(*(sizes[n] for n in SPLIT if n in sizes))
    # A split dim is s itself when g is all of it, else the compound (s, rest); Shardy
    # wants s sized explicitly only when no dim is s alone.
    whole = g == 1 or any(sizes[n] == g for n in SPLIT if n in sizes)
    factor_sizes = {} if whole else {"s": g}
    names: dict[str, str] = {}

    def dim(n: str):
        if n in SPLIT and g == 1:
            # T and R share no divisor: T stays splittable (so a token-sharded call reaches
            # the partition callback, which reports the sizes), R is replicated.
            return names.setdefault(n, "tok" if n == "T" else "rows")
        if n in SPLIT:
            if sizes[n] == g:
                return "s"
            factor_sizes[n.lower() + "x"] = sizes[n] // g
            return CompoundFactor("s", n.lower() + "x")
        return names.setdefault(n, f"f{len(names)}")

    ops = tuple(tuple(dim(n) for n in axes) for axes in arg_axes)
    outs = tuple(tuple(dim(n) for n in axes) for axes in out_axes)
    keep = {"s", "tok"} | {names.get(n) for n in local_names}
    # Shardy wants special factors listed in order of first appearance.
    seen: list[str] = []
    for d in (d for mapping in ops + outs for d in mapping):
        seen += [f for f in (d if isinstance(d, CompoundFactor) else (d,)) if f not in seen]
    replicate = tuple(f for f in seen if f not in keep)
    return SdyShardingRule(ops, outs, need_replication_factors=replicate, **factor_sizes)


def shard_count(tokens: int, local_tokens: int) -> int:
    """The number of token shards a per-shard function of :func:`split_over_tokens` runs
    in, read off its own operands: the global token count over its shard's (1 unsharded,
    and for a shard without tokens)."""
    return tokens // local_tokens if local_tokens else 1


def split_over_tokens(name: str, local: Callable, args: Sequence[jax.Array | None], arg_axes: Sequence[Axes],
                      out_axes: Sequence[Axes], backend: str,
                      summed: Mapping[int, int | None] | None = None) -> tuple[jax.Array | None, ...]:
    """``local(*args)``, run per token shard under SPMD as the module docstring says.

    ``local`` is what every shard runs on its own operands (and, unsharded, on the whole
    ones): it reads the shard's size off them; ``arg_axes``/``out_axes`` name each
    operand's and output's axes. The outputs at the positions ``summed`` maps are per-shard
    partial sums (without a token axis): the result holds their sum over the shards. Each
    maps to the position of the operand of its shape and axis names whose split the sum
    takes (a weight gradient to its weight; see the module docstring), or to ``None``.

    An operand may be ``None`` (an optional one not given): ``local`` gets ``None`` in its
    place, and an output it returns as ``None`` is ``None`` in the result. Both are left out
    of the partitioned call, whose operands and results must be arrays, so an op names its
    operands and axes once, whichever of them it is given. A summed output, and the operand
    it maps to, must be arrays.
    """
    summed = dict(summed or {})
    outs = jax.eval_shape(local, *args)
    for i, j in summed.items():
        if j is not None and (outs[i].shape, tuple(out_axes[i])) != (args[j].shape, tuple(arg_axes[j])):
            raise ValueError(f"{name}: summed output {i} has shape {outs[i].shape} and axes {tuple(out_axes[i])}; "
                             f"expected operand {j}'s {args[j].shape} and {tuple(arg_axes[j])}, whose split its "
                             "sum takes")
    given = [i for i, a in enumerate(args) if a is not None]
    made = [i for i, o in enumerate(outs) if o is not None]

    def present(*xs):
        full = local(*_placed(len(args), given, xs))
        return tuple(full[i] for i in made)

    results = _split_arrays(name, present, [args[i] for i in given], [arg_axes[i] for i in given],
                            [out_axes[i] for i in made], [outs[i] for i in made], backend,
                            {made.index(i): None if j is None else given.index(j) for i, j in summed.items()},
                            (LOCAL,))
    return tuple(_placed(len(outs), made, results))


def _placed(n: int, positions: Sequence[int], values: Sequence[Any]) -> list[Any]:
    """``n`` slots holding ``values`` at ``positions`` and ``None`` elsewhere."""
    slots: list[Any] = [None] * n
    for i, v in zip(positions, values):
        slots[i] = v
    return slots


def _split_arrays(name: str, local: Callable, args: Sequence[jax.Array], arg_axes: Sequence[Axes],
                  out_axes: Sequence[Axes], outs: Sequence[jax.ShapeDtypeStruct], backend: str,
                  summed: dict[int, int | None], local_names: Sequence[str]) -> tuple[jax.Array, ...]:
    """:func:`split_over_tokens` once every operand and output is an array; ``outs`` are
    ``local``'s output shapes, ``local_names`` the axes sliced along whatever shards them
    (``H`` and, under ``vmap``, the batch axes)."""
    sizes = {n: d for axes, a in zip(arg_axes, args) for n, d in zip(axes, a.shape)}
    sizes.update({n: d for axes, o in zip(out_axes, outs) for n, d in zip(axes, o.shape)})
    if backend == "interpret" or any(sizes.get(n, 1) == 0 for n in SPLIT) or partly_manual_unpartitioned():
        return first_order(name, lambda *xs: tuple(local(*xs)))(*args)

    def plans(mesh, arg_shapes, tokens) -> dict[int, tuple[tuple[int, Any], ...]]:
        if tokens is None:
            return {}
        found = {}
        for i, j in summed.items():
            if j is not None:
                # Under vmap the output has the batch axes that an unbatched operand (a weight
                # shared by the items) lacks: each of the operand's dimensions where the output has it.
                at = [out_axes[i].index(n) for n in arg_axes[j]]
                found[i] = tuple((at[d], ax) for d, ax in _scatter_plan(mesh, arg_shapes[j], tokens))
        return {i: p for i, p in found.items() if p}

    def infer(mesh, arg_shapes, result_shape):
        tokens = _split(mesh, arg_shapes, arg_axes, SPLIT)[0]
        local_axes = _local_splits(mesh, arg_shapes, arg_axes, local_names, tokens)
        return tuple(_out_shardings(mesh, out_axes, tokens, local_axes, plans(mesh, arg_shapes, tokens)))

    def partition(mesh, arg_shapes, result_shape):
        tokens, shards = _split(mesh, arg_shapes, arg_axes, SPLIT)
        # H split along part of a mesh axis: gathered (every row mover also runs on whole rows).
        local_axes = _local_splits(mesh, arg_shapes, arg_axes, local_names, tokens)
        # Raised through errors.keep: XLA runs this callback, and would otherwise hand the
        # error on only as text inside its own runtime error.
        where = f"of mesh axes {tokens}" if tokens is not None else "(split along part of a mesh axis)"
        for n in SPLIT:
            if n in sizes and sizes[n] % shards:
                raise errors.keep(ValueError(
                    f"{name}: its {'tokens' if n == 'T' else 'expert-sorted rows'} ({sizes[n]}) do not divide into "
                    f"the {shards} token shards {where}; choose sizes divisible by {shards}"))
        if tokens is None and shards > 1:
            raise errors.keep(ValueError(
                f"{name}: its tokens ({sizes.get('T')}) and expert-sorted rows ({sizes.get('R')}) arrive split "
                f"{shards} ways along part of a mesh axis, or along an automatic axis of a partly manual "
                "shard_map; expected them split along whole mesh axes, as a PartitionSpec names them (inside "
                "a shard_map, make the token axes manual)"))

        scatter = plans(mesh, arg_shapes, tokens)

        def run(*xs):
            outs = list(local(*xs))
            for i in summed if tokens is not None else ():
                outs[i] = _sum_over_tokens(outs[i], tokens, scatter.get(i, ()))
            return tuple(outs)
        return (mesh, run, tuple(_out_shardings(mesh, out_axes, tokens, local_axes, scatter)),
                tuple(_shardings(mesh, arg_axes, tokens, local_axes)))

    partitioned = custom_partitioning(lambda *xs: tuple(local(*xs)))
    # decode_shardings=False: the callbacks read the operands' shardings themselves
    # (dim_splits), so a split that does not divide reaches `partition`, which names it,
    # instead of failing in JAX's decoding of the result shardings.
    partitioned.def_partition(partition, infer_sharding_from_operands=infer,
                              propagate_user_sharding=lambda mesh, user_shape: tuple(u.sharding for u in user_shape),
                              sharding_rule=_rule(arg_axes, out_axes, sizes, local_names), decode_shardings=False)

    batched = custom_vmap(lambda *xs: partitioned(*xs))

    @batched.def_vmap
    def _vmap(axis_size, in_batched, *xs):
        # The same split with the batch as a leading local axis, each shard mapping `local`
        # over its batch items: mapped outside the partitioned call instead, the items'
        # calls would be partitioned by their kernels' rules, which gather the tokens.
        batch = next(f"vmap{i}" for i in itertools.count() if f"vmap{i}" not in local_names)
        mapped = jax.vmap(local, in_axes=tuple(0 if b else None for b in in_batched))
        # A summed output keeps following its operand's split, batched or not: each item's
        # sum is reduce-scattered along the operand's dimensions, the batch axis as it is.
        return tuple(_split_arrays(
            name, mapped, xs, [(batch,) * b + tuple(a) for a, b in zip(arg_axes, in_batched)],
            [(batch,) + tuple(o) for o in out_axes], jax.eval_shape(mapped, *xs), backend, summed,
            (batch,) + tuple(local_names))), (True,) * len(outs)

    # custom_partitioning and custom_vmap drop the operands' varying axes inside jax.shard_map.
    return first_order(name, lambda *xs: vary_like(batched(*_recheck(name, xs)), xs))(*args)


# The choice above is made at trace time, under the partitioner then set; a program traced
# under Shardy and lowered under GSPMD (jax_use_shardy_partitioner changed in between) would
# reach XLA with a custom_partitioning call where it aborts the process. An identity on the
# first operand checks the choice again at lowering and raises instead.
_recheck_p = Primitive("te_jax_perm_token_split_recheck")
_recheck_p.def_impl(lambda x, *, name: x)
_recheck_p.def_abstract_eval(lambda x, *, name: x)
batching.primitive_batchers[_recheck_p] = lambda xs, dims, *, name: (_recheck_p.bind(*xs, name=name), dims[0])


def _recheck_lowering(ctx, x, *, name):
    if partly_manual_unpartitioned(ctx):
        raise ValueError(
            f"{name}: traced to run per token shard inside a shard_map manual over some mesh axes only, and "
            "lowered where JAX's custom_partitioning fails there (jax_use_shardy_partitioner changed between "
            "tracing and lowering; under GSPMD XLA would abort the process); expected the same partitioner "
            "setting at both (trace again after changing it)")
    return [x]


mlir.register_lowering(_recheck_p, _recheck_lowering)


def _recheck(name: str, xs: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    return (_recheck_p.bind(xs[0], name=name), *xs[1:])
