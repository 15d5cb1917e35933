"""What is benchmarked: each op and direction at one shape, its inputs, and its honest bytes.

A :class:`Case` builds ``(fn, args)`` for a backend, where ``fn(*args)`` is one call of the
op (forward, or backward through the op's VJP with residuals precomputed), and counts the
bytes that call must move:

* dispatch fwd: read each token once (``T*H``), the routing map and the routed probs;
  write every output (permuted rows, permuted probs, row-id map, counts).
* combine fwd: read the permuted rows, routed merging probs and the row-id map; write ``T*H``.
* chunk sort: read and write the rows and probs; write the row map.
* backward passes: read the cotangents (and, for combine with probs, the forward rows
  that the prob gradient needs) and residual maps; write every gradient.
* make_row_id_map: read the routing map; write the map.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.shapes import MoEShape
from te_jax_perm.workloads import ep_chunks, tokens, topk_routing

F32 = 4


def nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass
class Problem:
    """One shape's device-resident inputs, shared by every case at that shape."""

    shape: MoEShape
    inp: jax.Array            # [T, H] tokens
    routing_map: jax.Array    # bool [T, E]
    probs: jax.Array          # f32 [T, E]
    permuted: jax.Array       # [num_out, H] rows in expert order (combine / chunk-sort input)
    row_id_map: jax.Array     # the dispatch row-id map for routing_map
    split_sizes: jax.Array    # int32 [ep * E/ep]
    sorted_indices: jax.Array
    sort_probs: jax.Array     # f32 [num_out]

    @staticmethod
    def make(shape: MoEShape, seed: int = 0) -> "Problem":
        import te_jax_perm as tp

        rng = np.random.default_rng(seed)
        rm, probs = (jnp.asarray(a) for a in topk_routing(rng, shape.T, shape.E, shape.k))
        inp = jnp.asarray(tokens(rng, shape.T, shape.H, jnp.dtype(shape.dtype)))
        # The reference backend builds the map: every backend must agree on it exactly.
        permuted, _, row_id_map, _, _ = jax.jit(
            lambda x, m: tp.token_dispatch(x, m, shape.num_out, backend="xla"))(inp, rm)
        split, order = ep_chunks(rng, shape.num_out, shape.ep, max(1, shape.E // shape.ep))
        return Problem(shape, inp, rm, probs, permuted, row_id_map, jnp.asarray(split), jnp.asarray(order),
                       jnp.asarray(rng.random(shape.num_out, np.float32)))


@dataclasses.dataclass(frozen=True)
class Built:
    fn: Callable[..., Any]
    args: tuple[Any, ...]     # args[0] is an array: the timing chain perturbs and donates it
    bytes: int


@dataclasses.dataclass(frozen=True)
class Case:
    op: str            # "token_dispatch", "token_combine", "sort_chunks_by_index", "make_row_id_map", "copy"
    direction: str     # "fwd", "bwd", or "train" (forward under differentiation, then backward)
    build: Callable[[Problem, str], Built]

    @property
    def name(self) -> str:
        return f"{self.op}.{self.direction}"


def _vjp_case(fwd: Callable[..., Any], primals: tuple[Any, ...], extra_read: Callable[[Problem], int],
              aux: Callable[[Problem], tuple[Any, ...]]):
    """Backward-only timing: the VJP closure (residuals included) is built once, outside.

    Integer inputs (maps, split sizes) travel as jit arguments: as closure constants XLA
    would constant-fold the reference's sorts at compile time (minutes at real sizes).
    """

    def build(p: Problem, backend: str) -> Built:
        outs, vjp = jax.jit(lambda a, *xs: jax.vjp(lambda *d: fwd(p, backend, a, *d), *xs))(aux(p), *primals(p))
        cts = jax.tree.map(lambda o: jnp.ones_like(o), outs)
        # Cotangents first: the timing chain perturbs args[0].
        return Built(lambda c, v: v(c), (cts, vjp), build.bytes(p, backend))

    def bwd_bytes(p: Problem, backend: str) -> int:
        """The cotangents read, the gradients written and ``extra_read``, from shapes alone."""
        def cts_and_grads(a, *xs):
            outs, vjp = jax.vjp(lambda *d: fwd(p, backend, a, *d), *xs)
            cts = jax.tree.map(jnp.ones_like, outs)
            return cts, vjp(cts)
        return nbytes(jax.eval_shape(cts_and_grads, aux(p), *primals(p))) + extra_read(p)

    build.bytes = bwd_bytes
    build.parts = (fwd, primals, aux)   # what a training-step case of the same op runs
    return build


def _train_case(fwd_case: Callable[[Problem, str], Built], bwd_case):
    """A training step's use of an op: its forward as differentiation runs it (which may keep
    more for the backward than the plain forward computes), then its backward, in one jit;
    the op and its operands are ``bwd_case``'s (a :func:`_vjp_case`). The bytes are the
    forward's plus the backward's (the latter from shapes, so nothing runs twice). Against a
    peer's forward plus backward this counts whatever a forward does for its backward, which
    the backward-only timing (residuals built outside) leaves out."""
    fwd, primals, aux = bwd_case.parts

    def build(p: Problem, backend: str) -> Built:
        xs, a = primals(p), aux(p)
        outs = jax.eval_shape(lambda a, *d: fwd(p, backend, a, *d), a, *xs)
        cts = jax.tree.map(lambda o: jnp.ones(o.shape, o.dtype), outs)

        def step(c, a, *d):
            y, vjp = jax.vjp(lambda *v: fwd(p, backend, a, *v), *d)
            return y, vjp(c)

        # Cotangents first: the timing chain perturbs args[0].
        return Built(step, (cts, a, *xs), fwd_case(p, backend).bytes + bwd_case.bytes(p, backend))

    return build


# -- token_dispatch ----------------------------------------------------------------------
def _dispatch(p: Problem, backend: str, aux, inp, probs):
    import te_jax_perm as tp

    (routing_map,) = aux
    out, pprobs, *_ = tp.token_dispatch(inp, routing_map, p.shape.num_out, probs=probs, backend=backend)
    return out, pprobs


def _dispatch_fwd(p: Problem, backend: str) -> Built:
    import te_jax_perm as tp

    s = p.shape
    fn = lambda inp, rm, probs: tp.token_dispatch(inp, rm, s.num_out, probs=probs, backend=backend)  # noqa: E731
    outs = jax.eval_shape(fn, p.inp, p.routing_map, p.probs)
    read = nbytes(p.inp) + nbytes(p.routing_map) + s.num_out * F32
    return Built(fn, (p.inp, p.routing_map, p.probs), read + nbytes(outs))


# -- token_combine -----------------------------------------------------------------------
def _combine(p: Problem, backend: str, aux, x, merging_probs):
    import te_jax_perm as tp

    (row_id_map,) = aux
    return tp.token_combine(x, row_id_map, merging_probs=merging_probs, backend=backend)


def _combine_fwd(p: Problem, backend: str) -> Built:
    import te_jax_perm as tp

    fn = lambda x, rid, mp: tp.token_combine(x, rid, merging_probs=mp, backend=backend)  # noqa: E731
    read = nbytes(p.permuted) + nbytes(p.row_id_map) + p.shape.num_out * F32
    return Built(fn, (p.permuted, p.row_id_map, p.probs), read + nbytes(p.inp))


# The merging-prob gradient reads the forward rows as well as the cotangent.
_combine_bwd = _vjp_case(_combine, lambda p: (p.permuted, p.probs),
                         lambda p: nbytes(p.row_id_map) + nbytes(p.permuted) + p.shape.num_out * F32,
                         lambda p: (p.row_id_map,))


# -- sort_chunks_by_index ----------------------------------------------------------------
def _sort(p: Problem, backend: str, aux, x, probs):
    import te_jax_perm as tp

    split_sizes, sorted_indices = aux
    out, pprobs, _ = tp.sort_chunks_by_index_with_probs(x, split_sizes, sorted_indices, probs, backend=backend)
    return out, pprobs


def _sort_fwd(p: Problem, backend: str) -> Built:
    import te_jax_perm as tp

    fn = lambda x, s, i, pr: tp.sort_chunks_by_index_with_probs(x, s, i, pr, backend=backend)  # noqa: E731
    args = (p.permuted, p.split_sizes, p.sorted_indices, p.sort_probs)
    outs = jax.eval_shape(fn, *args)
    return Built(fn, args, nbytes(args) + nbytes(outs))


# -- make_row_id_map ---------------------------------------------------------------------
def _row_id_map(p: Problem, backend: str) -> Built:
    import te_jax_perm as tp

    fn = lambda rm: tp.make_row_id_map(rm, p.shape.num_out, backend=backend)  # noqa: E731
    return Built(fn, (p.routing_map,), nbytes(p.routing_map) + nbytes(jax.eval_shape(fn, p.routing_map)))


CASES: tuple[Case, ...] = (
    Case("token_dispatch", "fwd", _dispatch_fwd),
    Case("token_dispatch", "bwd", _vjp_case(_dispatch, lambda p: (p.inp, p.probs),
                                            lambda p: nbytes(p.row_id_map), lambda p: (p.routing_map,))),
    Case("token_combine", "fwd", _combine_fwd),
    Case("token_combine", "bwd", _combine_bwd),
    # The combine forward keeps its map's row owners for the backward: the step counts them.
    Case("token_combine", "train", _train_case(_combine_fwd, _combine_bwd)),
    Case("sort_chunks_by_index", "fwd", _sort_fwd),
    Case("sort_chunks_by_index", "bwd", _vjp_case(_sort, lambda p: (p.permuted, p.sort_probs),
                                                  lambda p: p.shape.num_out * F32,
                                                  lambda p: (p.split_sizes, p.sorted_indices))),
    Case("make_row_id_map", "fwd", _row_id_map),
)

