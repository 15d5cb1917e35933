"""A complete Mixture-of-Experts layer in plain JAX on te_jax_perm's dispatch and combine.

    router (softmax over the top-k logits)
      -> te_jax_perm.token_dispatch          (rows grouped by expert, optionally padded)
      -> per-expert FFN with jax.lax.ragged_dot (group sizes = tokens_per_expert)
      -> te_jax_perm.token_combine           (weighted by the routing probabilities)

The layer runs under ``jax.jit`` with ``jax.grad`` of a loss through everything. Output and
gradients (input, router and both expert weights) are checked against a dense reference
that runs every expert on every token and masks by the routing; the script prints shapes,
the backend, max errors and the step time, and exits non-zero on a mismatch.

    python examples/moe_permute.py                          # small on CPU, Mixtral-size on GPU
    python examples/moe_permute.py --backend=interpret --tokens=32 --hidden=32
    python examples/moe_permute.py --align_size=16 --probs_in=dispatch
    python examples/moe_permute.py --ep_ranks=4 --align_size=16   # + chunk sort (EP regrouping)

With ``--ep_ranks`` > 1 the layer simulates expert parallelism on one device: each source
rank dispatches its own tokens and ``te_jax_perm.sort_chunks_by_index`` regroups the
received rows from (source rank, expert) to (expert, source rank) and back.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np

import te_jax_perm
from te_jax_perm.core import resolve_backend

FLAGS = flags.FLAGS
flags.DEFINE_integer("tokens", None, "tokens T (default: 256 on CPU, 8192 on GPU)")
flags.DEFINE_integer("hidden", None, "hidden size H (default: 128 on CPU, 4096 on GPU)")
flags.DEFINE_integer("ffn", None, "expert FFN inner size (default: 2*hidden on CPU, 4096 on GPU)")
flags.DEFINE_integer("experts", 8, "routed experts E")
flags.DEFINE_integer("topk", 2, "experts per token k")
flags.DEFINE_string("dtype", None, "token/weight dtype (default: float32 on CPU, bfloat16 on GPU)")
flags.DEFINE_integer("align_size", 0, "pad each expert's rows to a multiple of this (0: no padding)")
flags.DEFINE_string("backend", None, "te_jax_perm backend: triton, interpret or xla (default: the library's)")
flags.DEFINE_enum("probs_in", "combine", ["combine", "dispatch"],
                  "apply routing probabilities as token_combine's merging_probs, or to the "
                  "dispatched rows via token_dispatch's permuted_probs")
flags.DEFINE_integer("ep_ranks", 1, "simulate expert parallelism on one device: tokens split over this many "
                     "source ranks, each dispatching its own tokens; the received rows, grouped by "
                     "(source rank, expert), are regrouped by expert with sort_chunks_by_index and back")
flags.DEFINE_integer("steps", None, "timed steps (default: 3 on CPU, 20 on GPU)")
flags.DEFINE_integer("seed", 0, "random seed")

_TOLERANCE = {"float32": 2e-4, "bfloat16": 5e-2, "float16": 1e-2}


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    tokens: int = 256
    hidden: int = 128
    ffn: int = 256
    experts: int = 8
    topk: int = 2
    dtype: str = "float32"
    align_size: int | None = None
    backend: str | None = None
    probs_in: str = "combine"
    ep_ranks: int = 1
    steps: int = 3
    seed: int = 0

    @staticmethod
    def for_platform(**overrides: Any) -> "MoEConfig":
        """Defaults that finish quickly on a small CPU; Mixtral-8x7B-like sizes on a GPU."""
        gpu = jax.default_backend() == "gpu"
        base = (dict(tokens=8192, hidden=4096, dtype="bfloat16", steps=20) if gpu
                else dict(tokens=256, hidden=128, dtype="float32", steps=3))
        base.update({k: v for k, v in overrides.items() if v is not None})
        base.setdefault("ffn", 4096 if gpu else 2 * base["hidden"])
        return MoEConfig(**base)


@dataclasses.dataclass
class Report:
    ok: bool
    errors: dict[str, float]          # normalised max error per checked tensor
    tolerance: float
    backend: str
    step_ms: float
    step_ms_spread: tuple[float, float]
    shapes: dict[str, tuple[int, ...]]


# -- the layer ----------------------------------------------------------------------------
def init_params(cfg: MoEConfig, key: jax.Array) -> dict[str, jax.Array]:
    k1, k2, k3 = jax.random.split(key, 3)
    dt = jnp.dtype(cfg.dtype)
    return {
        "router": (jax.random.normal(k1, (cfg.hidden, cfg.experts)) / np.sqrt(cfg.hidden)).astype(jnp.float32),
        "w_in": (jax.random.normal(k2, (cfg.experts, cfg.hidden, cfg.ffn)) / np.sqrt(cfg.hidden)).astype(dt),
        "w_out": (jax.random.normal(k3, (cfg.experts, cfg.ffn, cfg.hidden)) / np.sqrt(cfg.ffn)).astype(dt),
    }


def route(router: jax.Array, x: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """Top-k routing: ``(routing_map bool [T, E], probs float32 [T, E])``, probs zero off-route."""
    logits = x.astype(jnp.float32) @ router
    top_logits, top_idx = jax.lax.top_k(logits, topk)
    weights = jax.nn.softmax(top_logits, axis=-1)
    onehot = jax.nn.one_hot(top_idx, logits.shape[-1], dtype=jnp.float32)  # [T, k, E]
    return onehot.sum(1) > 0, jnp.einsum("tk,tke->te", weights, onehot)


def expert_ffn(params: dict[str, jax.Array], rows: jax.Array, group_sizes: jax.Array, dtype: Any) -> jax.Array:
    """Grouped GEMMs; padded rows are zero and stay zero (no biases), rows past the groups too."""
    h = jax.lax.ragged_dot(rows, params["w_in"], group_sizes, preferred_element_type=jnp.float32)
    h = jax.nn.silu(h).astype(dtype)
    return jax.lax.ragged_dot(h, params["w_out"], group_sizes, preferred_element_type=jnp.float32)


def moe_layer(params: dict[str, jax.Array], x: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, dict]:
    """x [T, H] -> ([T, H], intermediates) through dispatch, grouped FFN and combine."""
    if cfg.ep_ranks > 1:
        return moe_layer_ep(params, x, cfg)
    routing_map, probs = route(params["router"], x, cfg.topk)
    num_out = x.shape[0] * cfg.topk
    dispatch_probs = probs if cfg.probs_in == "dispatch" else None
    rows, permuted_probs, row_id_map, pad_offsets, tokens_per_expert = te_jax_perm.token_dispatch(
        x, routing_map, num_out, probs=dispatch_probs, align_size=cfg.align_size, backend=cfg.backend)
    y = expert_ffn(params, rows, tokens_per_expert, x.dtype)
    if cfg.probs_in == "dispatch":
        y = y * permuted_probs[:, None]
        merging = None
    else:
        merging = probs
    out = te_jax_perm.token_combine(y.astype(x.dtype), row_id_map, merging_probs=merging,
                                    pad_offsets=pad_offsets, backend=cfg.backend)
    return out, {"dispatched rows": rows, "row_id_map": row_id_map, "tokens_per_expert": tokens_per_expert,
                 "output": out}


def moe_layer_ep(params: dict[str, jax.Array], x: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, dict]:
    """Expert parallelism simulated on one device (the all-to-all is the identity here).

    Each of ``ep`` source ranks dispatches its own tokens; the rows one expert device
    receives are grouped by (source rank, expert), each rank's block ending in its unused
    tail rows. ``sort_chunks_by_index`` regroups them by (expert, source rank) so that one
    grouped GEMM covers each expert, and the inverse sort restores the rank layout for
    each rank's combine.
    """
    ep, e = cfg.ep_ranks, cfg.experts
    t, hdim = x.shape
    if t % ep:
        raise ValueError(f"--tokens={t} must be divisible by --ep_ranks={ep}")
    routing_map, probs = route(params["router"], x, cfg.topk)
    xs, rms, ps = x.reshape(ep, t // ep, hdim), routing_map.reshape(ep, t // ep, e), probs.reshape(ep, t // ep, e)
    num_out = (t // ep) * cfg.topk
    use_dispatch_probs = cfg.probs_in == "dispatch"

    def dispatch(x, rm, p):
        return te_jax_perm.token_dispatch(x, rm, num_out, probs=p if use_dispatch_probs else None,
                                          align_size=cfg.align_size, backend=cfg.backend)

    rows, permuted_probs, row_id_map, pad_offsets, tpe = jax.vmap(dispatch)(xs, rms, ps)
    per_rank = rows.shape[1]
    # Chunks: per rank, its E expert groups then its tail; target order: (expert, rank), tails last.
    tails = per_rank - tpe.sum(axis=1, keepdims=True)
    split_sizes = jnp.concatenate([tpe, tails], axis=1).reshape(-1).astype(jnp.int32)   # [ep*(E+1)]
    chunk = lambda r, j: r * (e + 1) + j
    order = jnp.array([chunk(r, j) for j in range(e) for r in range(ep)] + [chunk(r, e) for r in range(ep)],
                      jnp.int32)
    flat_rows = rows.reshape(ep * per_rank, hdim)
    flat_probs = permuted_probs.reshape(-1) if use_dispatch_probs else None
    if use_dispatch_probs:
        sorted_rows, sorted_probs, sort_map = te_jax_perm.sort_chunks_by_index_with_probs(
            flat_rows, split_sizes, order, flat_probs, backend=cfg.backend)
    else:
        sorted_rows, sort_map = te_jax_perm.sort_chunks_by_index(flat_rows, split_sizes, order, backend=cfg.backend)
    y = expert_ffn(params, sorted_rows, tpe.sum(axis=0).astype(jnp.int32), x.dtype)
    if use_dispatch_probs:
        y = y * sorted_probs[:, None]
    y_back, _ = te_jax_perm.sort_chunks_by_map(y.astype(x.dtype), sort_map, is_forward=False, backend=cfg.backend)
    y_back = y_back.reshape(ep, per_rank, hdim)

    def combine(y, rid, p, pad):
        return te_jax_perm.token_combine(y, rid, merging_probs=None if use_dispatch_probs else p,
                                         pad_offsets=pad, backend=cfg.backend)

    out = jax.vmap(combine)(y_back, row_id_map, ps, pad_offsets).reshape(t, hdim)
    return out, {"rows per source rank": rows, "regrouped rows": sorted_rows, "chunk sort map": sort_map,
                 "tokens_per_expert": tpe, "output": out}


def dense_reference(params: dict[str, jax.Array], x: jax.Array, cfg: MoEConfig) -> jax.Array:
    """Every expert on every token in float32, masked by the routing probabilities."""
    _, probs = route(params["router"], x, cfg.topk)
    xf = x.astype(jnp.float32)
    h = jax.nn.silu(jnp.einsum("th,ehf->etf", xf, params["w_in"].astype(jnp.float32)))
    y = jnp.einsum("etf,efh->eth", h, params["w_out"].astype(jnp.float32))
    return jnp.einsum("te,eth->th", probs, y)


def _loss_target(cfg: MoEConfig, key: jax.Array) -> jax.Array:
    return jax.random.normal(key, (cfg.tokens, cfg.hidden), jnp.float32)


def _max_err(got: jax.Array, want: jax.Array) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-6))


# -- the run ------------------------------------------------------------------------------
def run_example(cfg: MoEConfig) -> Report:
    """Builds the layer, checks it against the dense reference, times the train step."""
    backend = resolve_backend(cfg.backend)
    cfg = dataclasses.replace(cfg, backend=backend)
    kp, kx, kt = jax.random.split(jax.random.PRNGKey(cfg.seed), 3)
    params = init_params(cfg, kp)
    x = jax.random.normal(kx, (cfg.tokens, cfg.hidden), jnp.float32).astype(cfg.dtype)
    target = _loss_target(cfg, kt)

    def loss(fn):
        def f(params, x):
            out = fn(params, x)
            return jnp.mean((out.astype(jnp.float32) - target) ** 2), out
        return f

    layer = lambda p, x: moe_layer(p, x, cfg)[0]
    step = jax.jit(jax.value_and_grad(loss(layer), argnums=(0, 1), has_aux=True))
    ref_step = jax.jit(jax.value_and_grad(loss(lambda p, x: dense_reference(p, x, cfg)), argnums=(0, 1),
                                          has_aux=True))

    shapes = {k: tuple(v.shape) for k, v in jax.eval_shape(lambda p, x: moe_layer(p, x, cfg)[1], params, x).items()}
    (l, out), (g_params, g_x) = step(params, x)
    jax.block_until_ready((l, out, g_params, g_x))
    (l_ref, out_ref), (g_params_ref, g_x_ref) = ref_step(params, x)

    errors = {
        "output": _max_err(out, out_ref),
        "loss": _max_err(l, l_ref),
        "grad input": _max_err(g_x, g_x_ref),
        "grad router": _max_err(g_params["router"], g_params_ref["router"]),
        "grad w_in": _max_err(g_params["w_in"], g_params_ref["w_in"]),
        "grad w_out": _max_err(g_params["w_out"], g_params_ref["w_out"]),
    }
    tol = _TOLERANCE.get(cfg.dtype, 5e-2)
    ok = all(np.isfinite(v) and v <= tol for v in errors.values())

    times = []
    for _ in range(max(1, cfg.steps)):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, x))
        times.append((time.perf_counter() - t0) * 1e3)
    return Report(ok, errors, tol, backend, statistics.median(times), (min(times), max(times)),
                  shapes)


def config_from_flags() -> MoEConfig:
    return MoEConfig.for_platform(
        tokens=FLAGS.tokens, hidden=FLAGS.hidden, ffn=FLAGS.ffn, experts=FLAGS.experts, topk=FLAGS.topk,
        dtype=FLAGS.dtype, align_size=FLAGS.align_size or None, backend=FLAGS.backend,
        probs_in=FLAGS.probs_in, ep_ranks=FLAGS.ep_ranks, steps=FLAGS.steps, seed=FLAGS.seed)


def print_report(cfg: MoEConfig, rep: Report) -> None:
    print(f"MoE layer: T={cfg.tokens} H={cfg.hidden} F={cfg.ffn} E={cfg.experts} k={cfg.topk} "
          f"dtype={cfg.dtype} align_size={cfg.align_size} probs_in={cfg.probs_in} ep_ranks={cfg.ep_ranks}")
    print(f"platform={jax.default_backend()} te_jax_perm backend={rep.backend}")
    for name, shape in rep.shapes.items():
        print(f"  {name:18s} {shape}")
    for name, err in rep.errors.items():
        flag = "ok" if err <= rep.tolerance else "MISMATCH"
        print(f"  max err {name:12s} {err:.3e}  (tol {rep.tolerance:.0e}, relative to max |ref|) {flag}")
    print(f"  train step (fwd+bwd, jitted): median {rep.step_ms:.2f} ms "
          f"[min {rep.step_ms_spread[0]:.2f}, max {rep.step_ms_spread[1]:.2f}] over {max(1, cfg.steps)} steps")
    print("PASS" if rep.ok else "FAIL: MoE layer does not match the dense reference")


def main(argv: list[str]) -> int:
    del argv
    cfg = config_from_flags()
    rep = run_example(cfg)
    print_report(dataclasses.replace(cfg, backend=rep.backend), rep)
    if not rep.ok:
        logging.error("mismatch against the dense reference: %s", rep.errors)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
