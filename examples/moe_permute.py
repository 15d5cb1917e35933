"""A Mixture-of-Experts layer on te_jax_perm, one training step checked against a dense reference.

    router (top-k of the logits, softmax over the k)
      -> te_jax_perm.token_dispatch    (rows grouped by expert, optionally padded)
      -> SwiGLU experts: te_jax_perm.grouped_matmul (gate and up), silu(gate) * up,
         te_jax_perm.grouped_matmul (down), one group of rows per expert
      -> te_jax_perm.token_combine     (weighted by the routing probabilities)

With --gemm=fused the experts run as te_jax_perm.moe_ffn: the same layer in one op, the
dispatch and the combine fused into the expert GEMMs (no dispatched copy of the tokens kept for
the backward).

The loss of one jitted training step, and its gradients in the input, the router and both
expert weights, are compared with a dense layer that runs every expert on every token and
masks by the routing. The last line is PASS or FAIL (exit status 0 or 1).

    python3 examples/moe_permute.py
    python3 examples/moe_permute.py --backend=interpret --tokens=32 --hidden=32
    python3 examples/moe_permute.py --align_size=16 --probs_in=dispatch
    python3 examples/moe_permute.py --ep_ranks=4       # + sort_chunks_by_index (EP regrouping)
    python3 examples/moe_permute.py --gemm=fused       # te_jax_perm.moe_ffn

With --ep_ranks > 1 the layer simulates expert parallelism on one device: each source rank
dispatches its own tokens, and sort_chunks_by_index regroups the received rows from
(source rank, expert) to (expert, source rank) and back. Step times at model sizes:
``python3 -m benchmarks.layer_bench``.
"""
from __future__ import annotations

import dataclasses

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import te_jax_perm
from te_jax_perm import cli

flags.DEFINE_integer("tokens", 256, "tokens T in the batch", lower_bound=1)
flags.DEFINE_integer("hidden", 128, "hidden size H of each token", lower_bound=1)
flags.DEFINE_integer("ffn", 256, "inner size F of each expert's SwiGLU FFN", lower_bound=1)
flags.DEFINE_integer("experts", 8, "routed experts E", lower_bound=1)
flags.DEFINE_integer("topk", 2, "experts per token k (at most --experts)", lower_bound=1)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "token and weight dtype")
flags.DEFINE_integer("align_size", 0, "pad each expert's rows to a multiple of this, as FP8 grouped GEMMs "
                     "want (0: no padding)", lower_bound=0)
flags.DEFINE_enum("backend", None, ["triton", "interpret", "xla"], "te_jax_perm backend: triton (GPU), "
                  "interpret (the Triton kernels in Triton's CPU interpreter, slow) or xla (plain JAX); "
                  "default: triton on a GPU, xla elsewhere")
flags.DEFINE_enum("gemm", None, ["triton", "interpret", "tokamax", "xla", "fused"], "the experts' grouped GEMM, "
                  "grouped_matmul's backend: triton (ours, GPU), interpret (ours in Triton's CPU interpreter), "
                  "tokamax (needs te_jax_perm[gemm]), xla (jax.lax.ragged_dot), or fused: the whole "
                  "dispatch-experts-combine as te_jax_perm.moe_ffn (with --probs_in=combine and --ep_ranks=1); "
                  "default: triton on a GPU, xla elsewhere")
flags.DEFINE_enum("probs_in", "combine", ["combine", "dispatch"], "where the routing probabilities apply: "
                  "token_combine's merging_probs, or the expert outputs via token_dispatch's permuted_probs")
flags.DEFINE_integer("ep_ranks", 1, "source ranks of the simulated expert parallelism (1: none); they split "
                     "--tokens evenly", lower_bound=1)
flags.DEFINE_integer("seed", 0, "random seed for inputs, weights and routing")
flags.register_multi_flags_validator(
    ["topk", "experts"], lambda f: f["topk"] <= f["experts"], "--topk must be at most --experts")
flags.register_multi_flags_validator(
    ["tokens", "ep_ranks"], lambda f: f["tokens"] % f["ep_ranks"] == 0,
    "--ep_ranks must divide --tokens: each simulated rank holds an equal share of the tokens")
flags.register_multi_flags_validator(
    ["gemm", "probs_in", "ep_ranks"],
    lambda f: f["gemm"] != "fused" or (f["probs_in"] == "combine" and f["ep_ranks"] == 1),
    "--gemm=fused runs with --probs_in=combine and --ep_ranks=1")

TOLERANCE = {"float32": 2e-4, "bfloat16": 5e-2, "float16": 1e-2}


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
    gemm: str | None = None
    probs_in: str = "combine"
    ep_ranks: int = 1
    seed: int = 0


def init_params(cfg: MoEConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Router float32 [H, E]; w_in [E, H, 2F] (gate and up side by side); w_out [E, F, H]."""
    k1, k2, k3 = jax.random.split(key, 3)
    dt, h, f, e = jnp.dtype(cfg.dtype), cfg.hidden, cfg.ffn, cfg.experts
    return {"router": jax.random.normal(k1, (h, e)) / np.sqrt(h),
            "w_in": (jax.random.normal(k2, (e, h, 2 * f)) / np.sqrt(h)).astype(dt),
            "w_out": (jax.random.normal(k3, (e, f, h)) / np.sqrt(f)).astype(dt)}


def route(router: jax.Array, x: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """``(routing_map bool [T, E], probs float32 [T, E])``, probs zero off the route."""
    top_logits, top_idx = jax.lax.top_k(x.astype(jnp.float32) @ router, topk)
    onehot = jax.nn.one_hot(top_idx, router.shape[1])                          # [T, k, E]
    return onehot.sum(1) > 0, jnp.einsum("tk,tke->te", jax.nn.softmax(top_logits, -1), onehot)


def swiglu(h: jax.Array) -> jax.Array:
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    return jax.nn.silu(gate) * up


def expert_ffn(params, rows: jax.Array, group_sizes: jax.Array, gemm: str | None) -> jax.Array:
    """The SwiGLU experts on rows grouped by expert; zero rows (padding) stay zero."""
    h = te_jax_perm.grouped_matmul(rows, params["w_in"], group_sizes, backend=gemm)
    return te_jax_perm.grouped_matmul(swiglu(h).astype(rows.dtype), params["w_out"], group_sizes, backend=gemm)


def moe_layer(params, x: jax.Array, cfg: MoEConfig) -> jax.Array:
    """x [T, H] -> [T, H]: route, dispatch, experts, combine."""
    if cfg.ep_ranks > 1:
        return moe_layer_ep(params, x, cfg)
    routing_map, probs = route(params["router"], x, cfg.topk)
    if cfg.gemm == "fused":      # the same layer in one op; SwiGLU is its "silu_glu" activation
        return te_jax_perm.moe_ffn(x, routing_map, probs, params["w_in"], params["w_out"], x.shape[0] * cfg.topk,
                                   activation="silu_glu", align_size=cfg.align_size, backend=cfg.backend)
    in_dispatch = cfg.probs_in == "dispatch"
    rows, permuted_probs, row_id_map, pad_offsets, tokens_per_expert = te_jax_perm.token_dispatch(
        x, routing_map, num_out_tokens=x.shape[0] * cfg.topk, probs=probs if in_dispatch else None,
        align_size=cfg.align_size, backend=cfg.backend)
    y = expert_ffn(params, rows, tokens_per_expert, cfg.gemm)
    if in_dispatch:
        y = (y.astype(jnp.float32) * permuted_probs[:, None]).astype(x.dtype)
    return te_jax_perm.token_combine(y, row_id_map, merging_probs=None if in_dispatch else probs,
                                     pad_offsets=pad_offsets, backend=cfg.backend)


def moe_layer_ep(params, x: jax.Array, cfg: MoEConfig) -> jax.Array:
    """The layer with each of ``ep_ranks`` source ranks dispatching and combining its own
    tokens; the rows an expert device receives are regrouped by expert and back."""
    ep, e, (t, hdim) = cfg.ep_ranks, cfg.experts, x.shape
    routing_map, probs = route(params["router"], x, cfg.topk)
    in_dispatch = cfg.probs_in == "dispatch"

    def dispatch(x, rm, p):
        return te_jax_perm.token_dispatch(x, rm, (t // ep) * cfg.topk, probs=p if in_dispatch else None,
                                          align_size=cfg.align_size, backend=cfg.backend)

    split = lambda a: a.reshape(ep, t // ep, a.shape[-1])                       # noqa: E731
    rows, permuted_probs, row_id_map, pad_offsets, tpe = jax.vmap(dispatch)(split(x), split(routing_map),
                                                                            split(probs))
    per_rank = rows.shape[1]
    # Chunks: per rank, its E expert groups then its unused tail; regrouped to (expert, rank),
    # tails last, so that one grouped GEMM covers each expert's rows from every rank.
    split_sizes = jnp.concatenate([tpe, per_rank - tpe.sum(1, keepdims=True)], 1).reshape(-1)
    order = jnp.array([r * (e + 1) + j for j in range(e + 1) for r in range(ep)], jnp.int32)
    by_expert, sort_map = te_jax_perm.sort_chunks_by_index(rows.reshape(ep * per_rank, hdim), split_sizes,
                                                           order, backend=cfg.backend)
    y = expert_ffn(params, by_expert, tpe.sum(0), cfg.gemm)
    y, _ = te_jax_perm.sort_chunks_by_map(y, sort_map, is_forward=False, backend=cfg.backend)
    y = y.reshape(ep, per_rank, hdim)
    if in_dispatch:       # per row, so it commutes with the chunk sort
        y = (y.astype(jnp.float32) * permuted_probs[..., None]).astype(x.dtype)

    def combine(y, rid, p, pad):
        return te_jax_perm.token_combine(y, rid, merging_probs=None if in_dispatch else p, pad_offsets=pad,
                                         backend=cfg.backend)

    return jax.vmap(combine)(y, row_id_map, split(probs), pad_offsets).reshape(t, hdim)


def dense_reference(params, x: jax.Array, cfg: MoEConfig) -> jax.Array:
    """Every expert on every token in float32, weighted by the (mostly zero) routing probabilities."""
    _, probs = route(params["router"], x, cfg.topk)
    f32 = lambda a: a.astype(jnp.float32)                                      # noqa: E731
    hi = jax.lax.Precision.HIGHEST      # a GPU would otherwise multiply float32 in TF32
    a = swiglu(jnp.einsum("th,ehf->tef", f32(x), f32(params["w_in"]), precision=hi)).astype(x.dtype)
    y = jnp.einsum("tef,efh->teh", f32(a), f32(params["w_out"]), precision=hi).astype(x.dtype)
    return jnp.einsum("te,teh->th", probs, f32(y), precision=hi)


def check(cfg: MoEConfig) -> dict[str, float]:
    """Max error, relative to the reference's largest value, of the loss, the output and
    every gradient of one training step."""
    kp, kx, kt = jax.random.split(jax.random.key(cfg.seed), 3)
    params = init_params(cfg, kp)
    x = jax.random.normal(kx, (cfg.tokens, cfg.hidden)).astype(cfg.dtype)
    target = jax.random.normal(kt, (cfg.tokens, cfg.hidden))

    def step(layer):
        def loss(params, x):
            out = layer(params, x)
            return jnp.mean(jnp.square(out.astype(jnp.float32) - target)), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    (loss, out), (g_params, g_x) = step(lambda p, x: moe_layer(p, x, cfg))(params, x)
    (ref_loss, ref_out), (ref_g_params, ref_g_x) = step(lambda p, x: dense_reference(p, x, cfg))(params, x)
    got = {"loss": loss, "output": out, "grad input": g_x, **{f"grad {k}": v for k, v in g_params.items()}}
    want = {"loss": ref_loss, "output": ref_out, "grad input": ref_g_x,
            **{f"grad {k}": v for k, v in ref_g_params.items()}}
    rel = lambda a, b: float(np.max(np.abs(np.float32(a) - np.float32(b))) / max(np.max(np.abs(np.float32(b))), 1e-6))
    return {name: rel(got[name], want[name]) for name in want}


def main(argv: list[str]) -> int:
    del argv
    f = flags.FLAGS
    backend = te_jax_perm.resolve_backend(f.backend)
    cfg = MoEConfig(f.tokens, f.hidden, f.ffn, f.experts, f.topk, f.dtype, f.align_size or None, backend,
                    f.gemm or te_jax_perm.resolve_backend(None), f.probs_in, f.ep_ranks, f.seed)
    experts = "experts fused with dispatch and combine (moe_ffn)" if cfg.gemm == "fused" else f"grouped GEMM {cfg.gemm}"
    print(f"MoE layer: T={cfg.tokens} H={cfg.hidden} F={cfg.ffn} E={cfg.experts} k={cfg.topk} {cfg.dtype}, "
          f"align_size={cfg.align_size}, probs in {cfg.probs_in}, ep_ranks={cfg.ep_ranks}; te_jax_perm backend "
          f"{cfg.backend}, {experts}, on {jax.devices()[0].device_kind}")
    errors, tol = check(cfg), TOLERANCE[cfg.dtype]
    for name, err in errors.items():
        print(f"  max error {name:14s} {err:.2e}  {'ok' if err <= tol else 'MISMATCH'} (tolerance {tol:.0e})")
    ok = all(err <= tol for err in errors.values())       # a NaN error is not <= tol
    print("PASS" if ok else "FAIL: the layer does not match the dense reference")
    return 0 if ok else 1


if __name__ == "__main__":
    cli.run(main)
