"""Expert-parallel MoE layer: local dispatch -> all-to-all -> chunk sort -> expert FFN ->
inverse sort -> all-to-all back -> local combine, under ``shard_map`` over mesh axis ``ep``
(and, optionally, data-parallel mesh axes that replicate the expert-parallel group).

Each of the ``ep`` devices of a group holds ``T`` tokens (its data shard) and ``E / ep``
experts (global experts ``r*E_l .. (r+1)*E_l - 1`` live on rank ``r``). Per device:

1. ``make_row_id_map`` + ``permute_with_mask_map`` sort the device's token rows by global
   expert, keeping at most ``num_out_tokens`` rows (later rows in expert-major order drop).
   Because experts are rank-major, the rows bound for rank ``r`` are one contiguous chunk.
2. Each chunk is cut to ``capacity`` rows (the rows past it, in the same expert-major
   order, drop) and exchanged, together with the per-expert row counts: either densely
   (``jax.lax.all_to_all`` of capacity-padded chunks) or raggedly
   (``jax.lax.ragged_all_to_all``, exactly the kept rows), see
   :mod:`te_jax_perm.parallel.exchange`; ``EPConfig.a2a`` picks, ``"auto"`` probes.
3. Received rows arrive grouped by (source rank, local expert); ``sort_chunks_by_index``
   regroups them by (local expert, source rank) so each local expert's rows are contiguous.
4. The expert FFN is two grouped GEMMs (:func:`te_jax_perm.grouped_matmul`) around the
   activation ``moe_ffn`` names (gated ones read ``w_in`` as gate and up columns side by
   side); the padding rows after the groups come out zero.
5. The inverse chunk sort, the reverse all-to-all and ``unpermute_with_mask_map`` (weighted
   by the routing probabilities) bring each token's expert outputs home and sum them.

With ``EPConfig.data_axes``, every index along those mesh axes is an independent copy of
the expert-parallel group: its own tokens, the same experts (the weights are replicated
along the data axes, so their gradients are summed over them), rows exchanged only inside
the group. With ``EPConfig.fsdp_axes`` the weights are not replicated along those axes but
split along their hidden dimension (FSDP): each call gathers them before its GEMMs, and
their gradients are reduce-scattered back (half an all-reduce's bytes).

Dropped rows contribute zero. Everything is differentiable: the ops have custom VJPs,
``all_to_all`` transposes to itself and ``ragged_all_to_all`` to the reverse ragged
exchange. :func:`te_jax_perm.parallel.reference_moe_layer` computes the same function densely on one device, with the same drop rules.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from te_jax_perm import _checks
from te_jax_perm.ops.chunk_sort.api import sort_chunks_by_index, sort_chunks_by_map
from te_jax_perm.core import BACKENDS as OP_BACKENDS, check_backend_name, resolve_backend, use_backend
from te_jax_perm.ops.grouped_gemm.api import BACKENDS as GEMM_BACKENDS, grouped_matmul
from te_jax_perm.ops.moe_ffn.api import check_layer_dtypes
from te_jax_perm.ops.moe_ffn.reference import activate, check_activation, check_expert_weights
from te_jax_perm.ops.permute.api import permute_with_mask_map, unpermute_with_mask_map
from te_jax_perm.ops.row_id_map.api import checked_routing_map, make_row_id_map
from te_jax_perm.parallel.a2a_support import resolve_a2a
from te_jax_perm.parallel.exchange import ragged_slices, return_rows, send_rows

@dataclasses.dataclass(frozen=True)
class EPConfig:
    """Static settings of the expert-parallel layer.

    Attributes:
      num_out_tokens: rows each device keeps after its local dispatch (``T * topk`` keeps
        every routed row); ``None`` is ``T * E``, room for every token routed to every
        expert: the dispatch and exchange buffers grow with it, so pass ``T * topk``.
      capacity: rows each device may send to each rank; ``None`` is the worst case
        (``min(num_out_tokens, T * E_local)``), so nothing drops at the exchange.
      axis: the mesh axis name of the expert-parallel group.
      data_axes: mesh axis names along which the expert-parallel group is replicated
        (data parallelism): each index along them has its own tokens and the same experts;
        the weights' gradients are summed over them. ``()``: none.
      fsdp_axes: axes of ``data_axes`` along which the expert weights' hidden dimension
        ``H`` is split (FSDP: ``w_in`` along its dim 1, ``w_out`` along its dim 2); each call
        all-gathers them and reduce-scatters their gradients. ``()``: none.
      activation: the activation between the expert GEMMs, one of ``moe_ffn``'s names:
        ``"silu_glu"`` (SwiGLU, the default, as ``moe_ffn``'s), ``"gelu_glu"`` (both gated:
        ``w_in`` is ``[E, H, 2F]``, gate columns first), ``"silu"``, ``"gelu"`` (tanh form)
        or ``"relu"`` (``w_in`` is ``[E, H, F]``); computed in float32.
      backend: the ops backend (``None``: the default; ``ep_moe_layer`` takes the default
        for its mesh's devices, ``"xla"`` on a CPU mesh even where JAX's default device is a
        GPU, and so does ``ep_moe_local`` where JAX tells it the mesh's platform).
      a2a: how rows cross devices: ``"dense"`` (``all_to_all`` of capacity-padded chunks),
        ``"ragged"`` (``ragged_all_to_all``, exactly the kept rows; needs backend support)
        or ``"auto"`` (ragged where a probe finds it works, else dense; dense where JAX runs
        several processes, which must all build the same exchange). Same results.
      gemm: the grouped GEMM of the experts, ``grouped_matmul``'s ``backend``: ``"triton"``,
        ``"interpret"``, ``"xla"`` or ``"tokamax"`` (``None``: its default, the op backend in
        effect (``backend`` above), or ``"xla"`` for dtypes the kernels do not compute in).
    """

    num_out_tokens: int | None = None
    capacity: int | None = None
    axis: str = "ep"
    data_axes: tuple[str, ...] = ()
    fsdp_axes: tuple[str, ...] = ()
    activation: str = "silu_glu"
    backend: str | None = None
    a2a: str = "auto"
    gemm: str | None = None

    def sizes(self, tokens: int, experts: int, experts_local: int) -> tuple[int, int]:
        """``(num_out_tokens, capacity)`` of a device holding ``tokens`` tokens, ``experts``
        experts in all and ``experts_local`` of them itself, ``None`` read as the defaults."""
        n = tokens * experts if self.num_out_tokens is None else int(self.num_out_tokens)
        return n, min(n, tokens * experts_local) if self.capacity is None else int(self.capacity)


def _chunk_order(ep: int, el: int) -> np.ndarray:
    """Chunk ids, as (source rank, local expert | pad) -> (local expert, source rank), pads last."""
    k = el + 1
    return np.array([s * k + j for j in range(el) for s in range(ep)] + [s * k + el for s in range(ep)],
                    np.int32)


def ep_moe_local(x: jax.Array, routing_map: jax.Array, probs: jax.Array, w_in: jax.Array, w_out: jax.Array,
                 cfg: EPConfig = EPConfig()) -> jax.Array:
    """The per-device body; call it inside ``shard_map`` over ``cfg.axis`` with this device's
    experts' weights whole (``ep_moe_layer`` gathers FSDP-split ones first). The arguments
    are checked as ``ep_moe_layer`` checks its own, here as one device's shares; the mesh
    axes of ``cfg.data_axes`` and ``cfg.fsdp_axes`` are ``ep_moe_layer``'s business and are
    not read.

    The exchange and the default backend follow the devices of the mesh the enclosing
    ``shard_map`` runs on, as ``ep_moe_layer``'s follow its mesh. Inside ``shard_map`` JAX
    gives that mesh's platform and device kind (``jax.sharding.get_abstract_mesh()``'s
    ``abstract_device``) but not its devices, so ``cfg.a2a`` ``"auto"`` or ``"ragged"`` is
    probed on ``ep`` devices of that platform and kind, and ops left on the default backend
    (``cfg.backend`` or ``cfg.gemm`` ``None``, no :func:`te_jax_perm.use_backend` scope
    around the call) take that platform's (``"xla"`` on a CPU mesh even where JAX's default
    device is a GPU). A ``shard_map`` over a ``jax.sharding.AbstractMesh`` made without
    devices tells neither: then the first ``ep`` of ``jax.devices()`` are probed and JAX's
    default backend decides. Where those are not the devices the computation runs on, set
    ``cfg.a2a`` (``"dense"`` runs everywhere) and ``cfg.backend`` yourself.

    Args:
      x: ``[T, H]`` this device's tokens.
      routing_map: ``[T, E]`` bool, global experts.
      probs: ``[T, E]`` float32 routing weights (only routed entries are used).
      w_in: ``[E_l, H, F]`` (``[E_l, H, 2F]`` for a gated activation) this device's
        experts' first weights; ``E = ep * E_l``.
      w_out: ``[E_l, F, H]``.
      cfg: :class:`EPConfig`.

    Returns:
      ``[T, H]`` in ``x.dtype``.

    Raises:
      TypeError, ValueError: naming the argument or ``EPConfig`` field that does not fit,
        before any op of the layer is traced; a ``ValueError`` also where ``cfg.axis`` is not a bound
        mesh axis (a call outside ``shard_map``).
    """
    x, routing_map, probs, w_in, w_out = _checked_args(x, routing_map, probs, w_in, w_out, cfg)
    try:
        ep = jax.lax.axis_size(cfg.axis)
    except NameError:
        raise ValueError(f"ep_moe_local: EPConfig.axis = {cfg.axis!r} is not a mesh axis bound here; expected a "
                         f"call inside jax.shard_map over a mesh with that axis (or call ep_moe_layer, which "
                         f"runs the shard_map)") from None
    check_shapes(x, routing_map, probs, w_in, w_out, cfg, ep)
    platform, devices = _shard_map_devices(ep)
    cfg = dataclasses.replace(cfg, a2a=resolve_a2a(cfg.a2a, devices))
    # As in ep_moe_layer: ops left on the default backend take the one for the mesh's
    # platform (each op resolves its backend when traced, inside this scope).
    with use_backend(resolve_backend(cfg.backend, platform)):
        return _local(x, routing_map, probs, w_in, w_out, cfg, ragged_slices(devices))


def _shard_map_devices(ep: int) -> tuple[str | None, tuple[jax.Device, ...]]:
    """The platform of the mesh the enclosing ``shard_map`` runs on and ``ep`` devices like
    its own (same platform and kind) for the ragged-exchange probe. JAX's abstract mesh
    carries a concrete mesh's platform and device kind, not its devices; a mesh made
    abstract without devices carries neither, and then (``None``, the first ``ep`` of
    ``jax.devices()``) is the best guess left."""
    # getattr: an abstract mesh without the attribute tells as little as one without devices.
    known = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if known is None:
        return None, tuple(jax.devices()[:ep])
    try:
        like = [d for d in jax.devices(known.platform) if d.device_kind == known.device_kind]
    except RuntimeError:   # no backend for that platform in this process
        like = []
    return known.platform, tuple(like[:ep] if len(like) >= ep else jax.devices()[:ep])


def _local(x: jax.Array, routing_map: jax.Array, probs: jax.Array, w_in: jax.Array, w_out: jax.Array,
           cfg: EPConfig, slices: int) -> jax.Array:
    """:func:`ep_moe_local` on checked arguments, with ``cfg.a2a`` resolved to ``"dense"``
    or ``"ragged"`` and the ragged exchange's ``slices`` per destination."""
    ep = jax.lax.axis_size(cfg.axis)
    t, e, el = x.shape[0], routing_map.shape[1], w_in.shape[0]
    n, cap = cfg.sizes(t, e, el)
    be, mode = cfg.backend, cfg.a2a

    # 1. local dispatch, rows sorted by global expert (rank-major)
    rid, kept = make_row_id_map(routing_map, num_out_tokens=n, backend=be)
    rows, _ = permute_with_mask_map(x, rid, kept, n, backend=be)

    # 2. cut per-destination chunks to the capacity and exchange them
    kr = kept.reshape(ep, el)
    in_rank = jnp.cumsum(kr, axis=1) - kr
    sent = jnp.clip(cap - in_rank, 0, kr)                              # [ep, E_l] rows sent
    rank_start = (jnp.cumsum(kr.sum(1)) - kr.sum(1)).astype(jnp.int32)
    recv_sizes = jax.lax.all_to_all(sent, cfg.axis, 0, 0)              # [ep(src), E_l]
    sent_tot, recv_tot = sent.sum(1).astype(jnp.int32), recv_sizes.sum(1).astype(jnp.int32)
    recv = send_rows(rows, rank_start, sent_tot, recv_tot, cap, cfg.axis, mode, slices)  # [ep*C, H]

    # 3. (source rank, local expert) -> (local expert, source rank)
    pad = cap - recv_sizes.sum(1)
    split_sizes = jnp.concatenate([recv_sizes, pad[:, None]], axis=1).reshape(-1)
    grouped, smap = sort_chunks_by_index(recv, split_sizes,
                                            jnp.asarray(_chunk_order(ep, el)), backend=be)

    # 4. expert FFN; every activation maps 0 to 0, so the padding tail comes out zero
    gs = recv_sizes.sum(0).astype(jnp.int32)
    hid = grouped_matmul(grouped, w_in, gs, preferred_element_type=jnp.float32, backend=cfg.gemm)
    y = grouped_matmul(activate(cfg.activation, hid).astype(w_out.dtype), w_out, gs,
                       preferred_element_type=jnp.float32, backend=cfg.gemm).astype(x.dtype)

    # 5. back home and combine
    back, _ = sort_chunks_by_map(y, smap, is_forward=False, backend=be)
    home = return_rows(back, rank_start, sent_tot, recv_tot, n, cfg.axis, mode, slices)
    weights = jnp.where(routing_map, probs, 0.0).astype(jnp.float32)
    return unpermute_with_mask_map(home, rid, merging_probs=weights, tokens_per_expert=kept, backend=be)


def ep_moe_layer(x: jax.Array, routing_map: jax.Array, probs: jax.Array, w_in: jax.Array, w_out: jax.Array,
                 mesh: Mesh, cfg: EPConfig = EPConfig()) -> jax.Array:
    """The expert-parallel MoE layer over ``mesh`` axis ``cfg.axis`` (size ``ep``), replicated
    along ``cfg.data_axes`` (sizes multiplying to ``D``; 1 without them).

    Args:
      x: ``[D * ep * T, H]`` tokens, split over the mesh axes ``(*cfg.data_axes, cfg.axis)``
        in that order: the device at data index ``d`` (row-major over the data axes) and
        rank ``r`` holds rows ``(d * ep + r) * T .. (d * ep + r + 1) * T - 1``.
      routing_map: ``[D * ep * T, E]`` bool.
      probs: ``[D * ep * T, E]`` float32.
      w_in: ``[E, H, F]``, ``[E, H, 2F]`` for a gated ``cfg.activation``; rank ``r`` holds
        experts ``r*E/ep .. (r+1)*E/ep - 1`` (whatever its data index), split along ``H``
        over ``cfg.fsdp_axes``.
      w_out: ``[E, F, H]``, split alike.
      mesh: a mesh with axis ``cfg.axis`` and the axes of ``cfg.data_axes``; along any
        other axis the layer is computed redundantly.
      cfg: :class:`EPConfig`; ``num_out_tokens`` and ``capacity`` are per device.

    Returns:
      ``[D * ep * T, H]``, sharded like ``x``. Differentiable in ``x``, ``probs``, ``w_in``
      and ``w_out`` (the weights' gradients summed over the data axes, reduce-scattered
      over the FSDP axes).
    """
    # Checked here, outside shard_map, where the routing map's values are still concrete.
    x, routing_map, probs, w_in, w_out = _checked_args(x, routing_map, probs, w_in, w_out, cfg)
    data_axes, fsdp = _check_layout(x, routing_map, probs, w_in, w_out, mesh, cfg)
    tokens = P((*data_axes, cfg.axis))
    split = fsdp or None
    # Rows cross devices only within an expert-parallel group: the exchange is probed on one
    # group's ep devices (as ep_moe_local probes), not on every device of the mesh.
    group = tuple(np.moveaxis(mesh.devices, mesh.axis_names.index(cfg.axis), -1).reshape(-1, mesh.shape[cfg.axis])[0])
    cfg = dataclasses.replace(cfg, data_axes=data_axes, fsdp_axes=fsdp, a2a=resolve_a2a(cfg.a2a, group))

    def body(x, routing_map, probs, w_in, w_out):
        if fsdp:   # whole weights for the GEMMs; the gather's transpose reduce-scatters the gradients
            w_in = jax.lax.all_gather(w_in, fsdp, axis=1, tiled=True)
            w_out = jax.lax.all_gather(w_out, fsdp, axis=2, tiled=True)
        return _local(x, routing_map, probs, w_in, w_out, cfg, ragged_slices(group))

    # Ops left on the default backend (cfg.backend or cfg.gemm None) take the one for the
    # mesh's devices: each op resolves its backend when the body is traced, inside this scope.
    with use_backend(resolve_backend(cfg.backend, group[0].platform)):
        return jax.shard_map(body, mesh=mesh, in_specs=(tokens,) * 3 + (P(cfg.axis, split), P(cfg.axis, None, split)),
                             out_specs=tokens)(x, routing_map, probs, w_in, w_out)


def _check_config(cfg: EPConfig) -> None:
    """The :class:`EPConfig` fields that need no mesh, as both layer entries take them
    (``a2a`` is :func:`resolve_a2a`'s to check, against the devices the layer runs on)."""
    if not isinstance(cfg, EPConfig):
        raise TypeError(f"cfg is {type(cfg).__name__} {cfg!r:.60}; expected a te_jax_perm.parallel.EPConfig")
    for field, names in (("backend", OP_BACKENDS), ("gemm", GEMM_BACKENDS)):
        if getattr(cfg, field) is not None:
            check_backend_name(getattr(cfg, field), names, f"EPConfig.{field}", optional=True)
    check_activation("EPConfig.activation", cfg.activation)
    for field in ("num_out_tokens", "capacity"):
        v = getattr(cfg, field)
        if v is None:
            continue
        # A float or a bool is the wrong type (TypeError, as the ops raise for sizes); a
        # negative int the wrong value.
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"EPConfig.{field} = {v!r}; expected None or an int >= 0")
        if v < 0:
            raise ValueError(f"EPConfig.{field} = {v!r}; expected None or an int >= 0")


def _checked_args(x, routing_map, probs, w_in, w_out, cfg: EPConfig) -> tuple[jax.Array, ...]:
    """What both layer entries check first, before any shape: ``cfg`` (:func:`_check_config`),
    the float arguments as the ops take arrays (lists too; ``None`` raises naming one) and
    the routing map. Returns ``(x, routing_map, probs, w_in, w_out)`` as arrays."""
    _check_config(cfg)
    x, probs, w_in, w_out = (_checks.array(name, a) for name, a in
                             (("x", x), ("probs", probs), ("w_in", w_in), ("w_out", w_out)))
    return x, checked_routing_map(routing_map), probs, w_in, w_out


def check_shapes(x: jax.Array, routing_map: jax.Array, probs: jax.Array, w_in: jax.Array, w_out: jax.Array,
                 cfg: EPConfig, ep: int, shards: int | None = None, over: str = "", fields: str = "EPConfig."
                 ) -> None:
    """The arrays' shapes and dtypes against each other and ``cfg``, on ``ep`` ranks: the
    layer's whole arrays (``x``'s rows split into ``shards`` token shards, ``over`` saying
    into what; the weights holding all ``E`` experts) or, with ``shards=None``, one device's
    (``x`` its tokens, the weights its ``E / ep`` experts). Messages name ``cfg``'s values as
    ``fields`` + their names: ``""`` where the caller took them as its own arguments (the
    dense reference, which has no mesh)."""
    local = shards is None
    ranks = f"the ep = {ep} ranks" + (f" of mesh axis {cfg.axis!r}" if fields else "")
    if x.ndim != 2 or (not local and x.shape[0] % shards):
        raise ValueError(f"x has shape {tuple(x.shape)}; expected " +
                         ("[T, H], this device's tokens" if local else
                          f"[tokens, H] with its rows split evenly into {over}"))
    if routing_map.ndim != 2 or routing_map.shape[0] != x.shape[0]:
        raise ValueError(f"routing_map has shape {tuple(routing_map.shape)}; expected [{x.shape[0]}, E] (one row "
                         "per row of x)")
    e, h = routing_map.shape[1], x.shape[1]
    if probs.shape != routing_map.shape:
        raise ValueError(f"probs has shape {tuple(probs.shape)}; expected {tuple(routing_map.shape)} (routing_map's)")
    if e % ep:
        raise ValueError(f"routing_map has E = {e} experts, which {ranks} "
                         "cannot split evenly; expected E divisible by ep")
    if local:
        check_expert_weights(w_in, w_out, e // ep, h, cfg.activation, "E_local",
                             f"routing_map's E = {e} over {ranks}", f"{fields}activation")
    else:
        check_expert_weights(w_in, w_out, e, h, cfg.activation, activation_name=f"{fields}activation")
    check_layer_dtypes(x, probs, w_in, w_out)
    # Each device's dispatch rows and its receive buffer of ep * capacity rows have int32
    # row indices, like every buffer the ops move rows in.
    n, cap = cfg.sizes(x.shape[0] // (shards or 1), e, e // ep)
    if n > _checks.INT32_MAX:
        raise ValueError(f"{fields}num_out_tokens = {cfg.num_out_tokens!r} makes {n} dispatch rows per device; "
                         "expected at most 2**31 - 1 (row indices are int32)")
    if ep * cap > _checks.INT32_MAX:
        raise ValueError(f"{fields}capacity = {cfg.capacity!r} makes a receive buffer of ep * capacity = {ep} * {cap} "
                         f"= {ep * cap} rows per device; expected at most 2**31 - 1 (row indices are int32)")


def _check_layout(x, routing_map, probs, w_in, w_out, mesh: Mesh, cfg: EPConfig
                  ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What ``shard_map`` and the collectives would otherwise report in their own terms;
    returns the data and FSDP axes as tuples."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh is {type(mesh).__name__} {mesh!r}; expected a jax.sharding.Mesh with the axis "
                        f"EPConfig.axis = {cfg.axis!r}")
    if cfg.axis not in mesh.axis_names:
        raise ValueError(f"mesh has axes {tuple(mesh.axis_names)}; EPConfig.axis = {cfg.axis!r} is not one of them")
    axes = {}
    for field in ("data_axes", "fsdp_axes"):
        given = getattr(cfg, field)
        if not (isinstance(given, str) or isinstance(given, (tuple, list)) and all(isinstance(a, str) for a in given)):
            # tuple() of None or of an int raises Python's error, naming no field
            raise TypeError(f"EPConfig.{field} = {given!r}; expected a mesh axis name or a tuple of them (() for none)")
        axes[field] = (given,) if isinstance(given, str) else tuple(given)
        for a in axes[field]:
            if a not in mesh.axis_names or a == cfg.axis or axes[field].count(a) > 1:
                raise ValueError(f"EPConfig.{field} = {given!r}; expected distinct axes of the mesh "
                                 f"{tuple(mesh.axis_names)} other than EPConfig.axis = {cfg.axis!r}")
    data_axes, fsdp = axes["data_axes"], axes["fsdp_axes"]
    if not set(fsdp) <= set(data_axes):
        # Along an axis that does not split the tokens every device computes the same
        # gradient: FSDP splits weights over data-parallel axes only.
        raise ValueError(f"EPConfig.fsdp_axes = {cfg.fsdp_axes!r}; expected axes of EPConfig.data_axes = "
                         f"{cfg.data_axes!r} (FSDP splits the weights over axes that split the tokens)")
    ep = mesh.shape[cfg.axis]
    shards = ep * int(np.prod([mesh.shape[a] for a in data_axes], dtype=np.int64))
    over = f"{shards} token shards: ep = {ep} (mesh axis {cfg.axis!r})" + (
        f" times the data axes {data_axes}" if data_axes else "")
    check_shapes(x, routing_map, probs, w_in, w_out, cfg, ep, shards, over)
    pieces = int(np.prod([mesh.shape[a] for a in fsdp], dtype=np.int64))
    if x.shape[1] % pieces:
        raise ValueError(f"x has H = {x.shape[1]} columns, which the {pieces} pieces of EPConfig.fsdp_axes = {fsdp} "
                         "cannot split evenly; expected H divisible by the product of their sizes")
    return data_axes, fsdp
