"""A complete Mixture-of-Experts layer in plain JAX on te_jax_perm, trained one step at a time.

    router (top-k of the logits, softmax over the k)
      -> te_jax_perm.token_dispatch    (rows grouped by expert, optionally padded)
      -> expert FFN, SwiGLU: te_jax_perm.grouped_matmul (gate and up), silu(gate) * up,
         te_jax_perm.grouped_matmul (down); group sizes = tokens_per_expert
      -> te_jax_perm.token_combine     (weighted by the routing probabilities)

One jitted training step (loss, then gradients of the input, the router and both expert
weights) is checked against a dense reference that runs every expert on every token and
masks by the routing. At real sizes the dense reference cannot run on every token, so the
check covers a subset of tokens (--check_tokens): the loss counts only those tokens, which
makes every gradient comparable, and the weight gradients are compared on the experts the
subset uses most.

It reports the step time, the GEMM limit measured in the same run (a dense FFN with the
same GEMM FLOPs: one expert's weights, T*k rows), their ratio, and on a GPU the share of
the step's kernel time spent in te_jax_perm's kernels, read from a profile.

    python examples/moe_permute.py                          # small, on CPU; Qwen3 size on a GPU
    python examples/moe_permute.py --preset=deepseek_v3     # T=8192 H=7168 E=256 k=8 F=2048
    python examples/moe_permute.py --backend=interpret --tokens=32 --hidden=32
    python examples/moe_permute.py --align_size=16 --probs_in=dispatch
    python examples/moe_permute.py --ep_ranks=4 --align_size=16   # + chunk sort (EP regrouping)

With --ep_ranks > 1 the layer simulates expert parallelism on one device: each source
rank dispatches its own tokens and ``te_jax_perm.sort_chunks_by_index`` regroups the
received rows from (source rank, expert) to (expert, source rank) and back.
The last line is PASS or FAIL (exit status 0 or 1).
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np

import te_jax_perm
from te_jax_perm.core import resolve_backend
from te_jax_perm.ops.grouped_gemm import default_impl

# name: (tokens, hidden, ffn, experts, topk). Real model shapes for GPUs, a small one for CPUs.
PRESETS = {
    "cpu": (256, 128, 256, 8, 2),
    "qwen3": (8192, 4096, 1536, 128, 8),         # Qwen3-235B-A22B-like MoE layer
    "deepseek_v3": (8192, 7168, 2048, 256, 8),
    "mixtral": (8192, 4096, 14336, 8, 2),        # Mixtral-8x7B-like
}

FLAGS = flags.FLAGS
flags.DEFINE_enum("preset", None, list(PRESETS),
                  "layer shape: tokens, hidden, ffn, experts, topk. cpu = 256,128,256,8,2; qwen3 = "
                  "8192,4096,1536,128,8; deepseek_v3 = 8192,7168,2048,256,8; mixtral = 8192,4096,14336,8,2. "
                  "Default: qwen3 on a GPU, cpu elsewhere. --tokens, --hidden, --ffn, --experts and --topk override single values.")
flags.DEFINE_integer("tokens", None, "tokens T in the batch (default: from --preset)")
flags.DEFINE_integer("hidden", None, "hidden size H of each token (default: from --preset)")
flags.DEFINE_integer("ffn", None, "inner size F of each expert's SwiGLU FFN (default: from --preset)")
flags.DEFINE_integer("experts", None, "routed experts E (default: from --preset)")
flags.DEFINE_integer("topk", None, "experts per token k (default: from --preset)")
flags.DEFINE_string("dtype", None, "token and weight dtype: bfloat16, float16 or float32 "
                    "(default: bfloat16 on a GPU, float32 elsewhere)")
flags.DEFINE_integer("align_size", 0, "pad each expert's rows to a multiple of this, as FP8 grouped GEMMs want "
                     "(0: no padding)")
flags.DEFINE_string("backend", None, "te_jax_perm kernel backend: triton (GPU), interpret (the Triton kernels on "
                    "the CPU interpreter, slow) or xla (plain JAX) (default: triton on a GPU, xla elsewhere)")
flags.DEFINE_enum("gemm", "auto", ["auto", "triton", "tokamax", "xla"],
                  "expert grouped GEMM: triton (our Triton grouped GEMM), tokamax (tokamax's ragged_dot on "
                  "GPUs, needs te_jax_perm[gemm]), xla (jax.lax.ragged_dot: exact everywhere, but XLA:GPU "
                  "densifies it over all experts) or auto (triton on a GPU, else xla)")
flags.DEFINE_enum("probs_in", "combine", ["combine", "dispatch"],
                  "where the routing probabilities are applied: as token_combine's merging_probs, or to the "
                  "expert outputs via token_dispatch's permuted_probs")
flags.DEFINE_integer("ep_ranks", 1, "simulate expert parallelism on one device: tokens split over this many "
                     "source ranks, each dispatching its own tokens; the received rows, grouped by "
                     "(source rank, expert), are regrouped by expert with sort_chunks_by_index and back")
flags.DEFINE_integer("steps", None, "timed training steps (default: 3 on CPU, 20 on a GPU)")
flags.DEFINE_integer("check_tokens", 256, "tokens checked against the dense reference (all when T is at most "
                     "this); the loss of the checked step counts only these tokens")
flags.DEFINE_bool("profile", None, "profile 3 steps and report the share of kernel time in te_jax_perm's "
                  "kernels (GPU only; default: on for GPUs)")
flags.DEFINE_string("json_out", None, "also write the report as JSON to this file")
flags.DEFINE_integer("seed", 0, "random seed for inputs, weights and routing")

_TOLERANCE = {"float32": 2e-4, "bfloat16": 5e-2, "float16": 1e-2}
_MAX_CHECKED_EXPERTS = 4   # weight gradients compared on this many experts when E is large


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
    steps: int = 3
    check_tokens: int = 256
    profile: bool = False
    seed: int = 0
    preset: str = "custom"

    @staticmethod
    def for_platform(preset: str | None = None, **overrides: Any) -> "MoEConfig":
        """The preset (default: qwen3 on a GPU, cpu elsewhere) with ``overrides`` that are not None."""
        gpu = jax.default_backend() == "gpu"
        preset = preset or ("qwen3" if gpu else "cpu")
        t, h, f, e, k = PRESETS[preset]
        base = dict(tokens=t, hidden=h, ffn=f, experts=e, topk=k, preset=preset,
                    dtype="bfloat16" if gpu else "float32", steps=20 if gpu else 3, profile=gpu)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return MoEConfig(**base)

    @property
    def gemm_impl(self) -> str:
        return default_impl(self.dtype, self.dtype) if self.gemm in (None, "auto") else self.gemm

    @property
    def routed_rows(self) -> int:
        return self.tokens * self.topk


@dataclasses.dataclass
class Report:
    ok: bool
    errors: dict[str, float]          # normalised max error per checked tensor
    tolerance: float
    backend: str
    gemm: str
    checked_tokens: int
    checked_experts: list[int]
    step_ms: float
    step_ms_spread: tuple[float, float]
    gemm_limit_ms: float
    gemm_tflops: float                # the layer's GEMM FLOPs (fwd+bwd) per step, in TFLOP
    profile: dict[str, Any] | None
    shapes: dict[str, tuple[int, ...]]

    @property
    def step_over_gemm_limit(self) -> float:
        return self.step_ms / self.gemm_limit_ms


# -- the layer ----------------------------------------------------------------------------
def init_params(cfg: MoEConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Router float32 [H, E]; w_in [E, H, 2F] (gate and up side by side); w_out [E, F, H]."""
    k1, k2, k3 = jax.random.split(key, 3)
    dt = jnp.dtype(cfg.dtype)
    return {
        "router": (jax.random.normal(k1, (cfg.hidden, cfg.experts)) / np.sqrt(cfg.hidden)).astype(jnp.float32),
        "w_in": (jax.random.normal(k2, (cfg.experts, cfg.hidden, 2 * cfg.ffn), dt) / np.sqrt(cfg.hidden)).astype(dt),
        "w_out": (jax.random.normal(k3, (cfg.experts, cfg.ffn, cfg.hidden), dt) / np.sqrt(cfg.ffn)).astype(dt),
    }


def route(router: jax.Array, x: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """Top-k routing: ``(routing_map bool [T, E], probs float32 [T, E])``, probs zero off-route."""
    logits = x.astype(jnp.float32) @ router
    top_logits, top_idx = jax.lax.top_k(logits, topk)
    weights = jax.nn.softmax(top_logits, axis=-1)
    onehot = jax.nn.one_hot(top_idx, logits.shape[-1], dtype=jnp.float32)  # [T, k, E]
    return onehot.sum(1) > 0, jnp.einsum("tk,tke->te", weights, onehot)


def swiglu(h: jax.Array) -> jax.Array:
    """[.., 2F] -> [.., F]: silu(gate) * up, in float32. Maps zero rows to zero rows."""
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    return jax.nn.silu(gate) * up


def expert_ffn(params: dict[str, jax.Array], rows: jax.Array, group_sizes: jax.Array, gemm: str) -> jax.Array:
    """Grouped SwiGLU FFN over rows grouped by expert; padding rows and rows past the groups stay zero."""
    h = te_jax_perm.grouped_matmul(rows, params["w_in"], group_sizes, impl=gemm)
    a = swiglu(h).astype(rows.dtype)
    return te_jax_perm.grouped_matmul(a, params["w_out"], group_sizes, impl=gemm)


def moe_layer(params: dict[str, jax.Array], x: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, dict]:
    """x [T, H] -> ([T, H], intermediates) through dispatch, grouped FFN and combine."""
    if cfg.ep_ranks > 1:
        return moe_layer_ep(params, x, cfg)
    routing_map, probs = route(params["router"], x, cfg.topk)
    dispatch_probs = probs if cfg.probs_in == "dispatch" else None
    rows, permuted_probs, row_id_map, pad_offsets, tokens_per_expert = te_jax_perm.token_dispatch(
        x, routing_map, num_out_tokens=x.shape[0] * cfg.topk, probs=dispatch_probs, align_size=cfg.align_size,
        backend=cfg.backend)
    y = expert_ffn(params, rows, tokens_per_expert, cfg.gemm_impl)
    if cfg.probs_in == "dispatch":
        y = (y.astype(jnp.float32) * permuted_probs[:, None].astype(jnp.float32)).astype(x.dtype)
    out = te_jax_perm.token_combine(y, row_id_map, merging_probs=None if cfg.probs_in == "dispatch" else probs,
                                    pad_offsets=pad_offsets, backend=cfg.backend)
    return out, {"dispatched rows": rows, "row_id_map": row_id_map, "tokens_per_expert": tokens_per_expert,
                 "output": out}


def moe_layer_ep(params: dict[str, jax.Array], x: jax.Array, cfg: MoEConfig) -> tuple[jax.Array, dict]:
    """Expert parallelism simulated on one device (the all-to-all is the identity here).

    Each of ``ep`` source ranks dispatches its own tokens; the rows one expert device
    receives are grouped by (source rank, expert), each rank's block ending in its unused
    tail rows. ``sort_chunks_by_index`` regroups them by (expert, source rank) so that one
    grouped GEMM covers each expert, and the inverse sort restores the rank layout for
    each rank's combine (where the routing probabilities are applied, in either mode).
    """
    ep, e = cfg.ep_ranks, cfg.experts
    t, hdim = x.shape
    if t % ep:
        raise ValueError(f"--tokens={t} must be divisible by --ep_ranks={ep}")
    routing_map, probs = route(params["router"], x, cfg.topk)
    xs, rms, ps = x.reshape(ep, t // ep, hdim), routing_map.reshape(ep, t // ep, e), probs.reshape(ep, t // ep, e)
    use_dispatch_probs = cfg.probs_in == "dispatch"

    def dispatch(x, rm, p):
        return te_jax_perm.token_dispatch(x, rm, num_out_tokens=(t // ep) * cfg.topk,
                                          probs=p if use_dispatch_probs else None,
                                          align_size=cfg.align_size, backend=cfg.backend)

    rows, permuted_probs, row_id_map, pad_offsets, tpe = jax.vmap(dispatch)(xs, rms, ps)
    per_rank = rows.shape[1]
    # Chunks: per rank, its E expert groups then its tail; target order: (expert, rank), tails last.
    tails = per_rank - tpe.sum(axis=1, keepdims=True)
    split_sizes = jnp.concatenate([tpe, tails], axis=1).reshape(-1).astype(jnp.int32)   # [ep*(E+1)]
    chunk = lambda r, j: r * (e + 1) + j
    order = jnp.array([chunk(r, j) for j in range(e) for r in range(ep)] + [chunk(r, e) for r in range(ep)],
                      jnp.int32)
    sorted_rows, sort_map = te_jax_perm.sort_chunks_by_index(rows.reshape(ep * per_rank, hdim), split_sizes, order,
                                                             backend=cfg.backend)
    y = expert_ffn(params, sorted_rows, tpe.sum(axis=0).astype(jnp.int32), cfg.gemm_impl)
    y_back, _ = te_jax_perm.sort_chunks_by_map(y, sort_map, is_forward=False, backend=cfg.backend)
    y_back = y_back.reshape(ep, per_rank, hdim)
    if use_dispatch_probs:   # per row, so it commutes with the chunk sort: apply it in the rank layout
        y_back = (y_back.astype(jnp.float32) * permuted_probs[..., None]).astype(x.dtype)

    def combine(y, rid, p, pad):
        return te_jax_perm.token_combine(y, rid, merging_probs=None if use_dispatch_probs else p,
                                         pad_offsets=pad, backend=cfg.backend)

    out = jax.vmap(combine)(y_back, row_id_map, ps, pad_offsets).reshape(t, hdim)
    return out, {"rows per source rank": rows, "regrouped rows": sorted_rows, "chunk sort map": sort_map,
                 "tokens_per_expert": tpe, "output": out}


def dense_reference(params: dict[str, jax.Array], frozen: dict[str, jax.Array], x: jax.Array, topk: int,
                    experts: jax.Array) -> jax.Array:
    """Every expert on every token, masked by the routing probabilities; float32 accumulation.

    ``params`` holds the router and the weights of the experts listed in ``experts``
    (``w_in_q``, ``w_out_q``); ``frozen`` holds all experts' weights (``w_in``, ``w_out``),
    not differentiated, so the reference never builds a gradient of the full expert weights
    (tens of GiB at real sizes).
    """
    _, probs = route(params["router"], x, topk)
    h = _einsum32("th,ehf->tef", x, frozen["w_in"])
    h = h.at[:, experts].set(_einsum32("th,ehf->tef", x, params["w_in_q"]))
    a = swiglu(h).astype(x.dtype)
    y = _einsum32("tef,efh->teh", a, frozen["w_out"])
    y = y.at[:, experts].set(_einsum32("tef,efh->teh", a[:, experts], params["w_out_q"]))
    return jnp.einsum("te,teh->th", probs, y.astype(x.dtype).astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def _einsum32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum with float32 results. XLA:CPU has no 16-bit dot with a float32 result, so there
    the operands are widened (small problems); on GPUs they stay 16-bit (tens of GiB)."""
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    # HIGHEST: on GPUs XLA would otherwise multiply float32 in TF32, and the reference must
    # be more accurate than what it checks.
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def layer_gemm_flops(cfg: MoEConfig) -> float:
    """GEMM FLOPs of one training step: forward 2*M*H*2F + 2*M*F*H, backward twice that (M = T*k)."""
    return 3 * (2 * cfg.routed_rows * cfg.hidden * 2 * cfg.ffn + 2 * cfg.routed_rows * cfg.ffn * cfg.hidden)


def dense_ffn_step(cfg: MoEConfig) -> tuple[Callable, tuple]:
    """The GEMM limit: one dense SwiGLU FFN over T*k rows with one expert's weights, fwd+bwd:
    the same GEMM FLOPs as the layer with no routing, permutation or grouping."""
    kx, k1, k2 = jax.random.split(jax.random.PRNGKey(cfg.seed + 1), 3)
    dt = jnp.dtype(cfg.dtype)
    rows = jax.random.normal(kx, (cfg.routed_rows, cfg.hidden), dt)
    w_in = (jax.random.normal(k1, (cfg.hidden, 2 * cfg.ffn), dt) / np.sqrt(cfg.hidden)).astype(dt)
    w_out = (jax.random.normal(k2, (cfg.ffn, cfg.hidden), dt) / np.sqrt(cfg.ffn)).astype(dt)

    def loss(rows, w_in, w_out):
        y = swiglu(rows @ w_in).astype(dt) @ w_out
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (rows, w_in, w_out)


def time_steps(fn: Callable, args: tuple, steps: int) -> list[float]:
    """Wall milliseconds per call, blocked until ready, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(max(1, steps)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return times


# -- profile ------------------------------------------------------------------------------
def our_kernel_names() -> set[str]:
    """The names of te_jax_perm's Triton kernels (GPU kernel events carry these names)."""
    import importlib
    import pkgutil
    import te_jax_perm.kernels as kernels_pkg
    names = set()
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        mod = importlib.import_module(f"te_jax_perm.kernels.{info.name}")
        for obj in vars(mod).values():
            fn = getattr(obj, "fn", None)     # triton.JITFunction wraps the Python function
            if fn is not None and callable(fn) and getattr(fn, "__module__", "") == mod.__name__:
                names.add(fn.__name__)
    return names


def kernel_times_from_profile(step: Callable, args: tuple, steps: int = 3) -> dict[str, Any]:
    """Runs ``steps`` calls under ``jax.profiler`` and sums GPU kernel time by kernel name.

    A kernel is te_jax_perm's when its name is one of our Triton kernels or any of its
    annotations mentions ``te_jax_perm`` (our custom calls are named ``te_jax_perm.<kernel>``).
    """
    ours = our_kernel_names()
    jax.block_until_ready(step(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                jax.block_until_ready(step(*args))
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError("the profiler wrote no .xplane.pb")
        data = jax.profiler.ProfileData.from_file(paths[0])
    by_name: dict[str, float] = collections.Counter()
    our_ns = 0.0
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        streams = [l for l in lines if "stream" in l.name.lower()] or lines   # not the derived op/module lines
        for line in streams:
            for ev in line.events:
                by_name[ev.name] += ev.duration_ns
                stats = " ".join(str(v) for _, v in ev.stats)
                if ev.name in ours or "te_jax_perm" in ev.name or "te_jax_perm" in stats:
                    our_ns += ev.duration_ns
    total = sum(by_name.values())
    if total == 0:
        raise RuntimeError("the profile holds no GPU kernel events")
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {"steps": steps, "kernel_ms_per_step": total / steps / 1e6, "ours_ms_per_step": our_ns / steps / 1e6,
            "ours_share_of_kernel_time": our_ns / total,
            "top_kernels_ms_per_step": {k: v / steps / 1e6 for k, v in top}}


# -- the run ------------------------------------------------------------------------------
def _max_err(got: jax.Array, want: jax.Array) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-6))


def _checked_experts(routing_map: np.ndarray, experts: int) -> np.ndarray:
    """All experts when there are few, else the ones the checked tokens use most."""
    if experts <= 2 * _MAX_CHECKED_EXPERTS:
        return np.arange(experts)
    return np.sort(np.argsort(-routing_map.sum(0), kind="stable")[:_MAX_CHECKED_EXPERTS])


def run_example(cfg: MoEConfig) -> Report:
    """Builds the layer, checks it against the dense reference, times the train step."""
    backend = resolve_backend(cfg.backend)
    cfg = dataclasses.replace(cfg, backend=backend, gemm=cfg.gemm_impl)
    kp, kx, kt = jax.random.split(jax.random.PRNGKey(cfg.seed), 3)
    params = jax.jit(init_params, static_argnums=0)(cfg, kp)   # jitted: no float32 temporaries
    x = jax.random.normal(kx, (cfg.tokens, cfg.hidden), jnp.float32).astype(cfg.dtype)
    target = jax.random.normal(kt, (cfg.tokens, cfg.hidden), jnp.float32)
    s = min(cfg.tokens, cfg.check_tokens)

    def loss(out, weights, target):
        # Mean over the counted tokens: the weights select which tokens the loss sees.
        per_token = jnp.sum(jnp.square(out.astype(jnp.float32) - target), axis=-1)
        return jnp.sum(weights * per_token) / (jnp.sum(weights) * out.shape[-1])

    def layer_loss(params, x, weights):
        out = moe_layer(params, x, cfg)[0]
        return loss(out, weights, target), out

    step = jax.jit(jax.value_and_grad(layer_loss, argnums=(0, 1), has_aux=True))
    shapes = {k: tuple(v.shape) for k, v in jax.eval_shape(lambda p, x: moe_layer(p, x, cfg)[1], params, x).items()}

    # The checked step: loss over the first s tokens only, same compiled program as the timed one.
    check_w = (jnp.arange(cfg.tokens) < s).astype(jnp.float32)
    (l, out), (g_params, g_x) = jax.block_until_ready(step(params, x, check_w))
    routing_s = np.asarray(route(params["router"], x[:s], cfg.topk)[0])
    q = jnp.asarray(_checked_experts(routing_s, cfg.experts))
    ref_params = {"router": params["router"], "w_in_q": params["w_in"][q], "w_out_q": params["w_out"][q]}
    frozen = {"w_in": params["w_in"], "w_out": params["w_out"]}

    def ref_loss(p, xs, frozen):
        out = dense_reference(p, frozen, xs, cfg.topk, q)
        return loss(out, jnp.ones((s,), jnp.float32), target[:s]), out

    (l_ref, out_ref), (g_ref, g_x_ref) = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True))(
        ref_params, x[:s], frozen)
    errors = {
        "output": _max_err(out[:s], out_ref),
        "loss": _max_err(l, l_ref),
        "grad input": _max_err(g_x[:s], g_x_ref),
        "grad router": _max_err(g_params["router"], g_ref["router"]),
        "grad w_in": _max_err(g_params["w_in"][q], g_ref["w_in_q"]),
        "grad w_out": _max_err(g_params["w_out"][q], g_ref["w_out_q"]),
    }
    del g_params, g_x, g_ref, ref_params, frozen
    tol = _TOLERANCE.get(cfg.dtype, 5e-2)
    ok = all(np.isfinite(v) and v <= tol for v in errors.values())

    all_w = jnp.ones((cfg.tokens,), jnp.float32)
    times = time_steps(step, (params, x, all_w), cfg.steps)
    dense_step, dense_args = dense_ffn_step(cfg)
    gemm_ms = statistics.median(time_steps(dense_step, dense_args, cfg.steps))
    del dense_args
    profile = None
    if cfg.profile:
        try:
            profile = kernel_times_from_profile(step, (params, x, all_w))
        except Exception as e:  # noqa: BLE001 - the report says why instead of failing the run
            profile = {"error": f"{type(e).__name__}: {e}"}
    return Report(ok, errors, tol, backend, cfg.gemm, s, [int(i) for i in q], statistics.median(times),
                  (min(times), max(times)), gemm_ms, layer_gemm_flops(cfg) / 1e12, profile, shapes)


def config_from_flags() -> MoEConfig:
    return MoEConfig.for_platform(
        FLAGS.preset, tokens=FLAGS.tokens, hidden=FLAGS.hidden, ffn=FLAGS.ffn, experts=FLAGS.experts,
        topk=FLAGS.topk, dtype=FLAGS.dtype, align_size=FLAGS.align_size or None, backend=FLAGS.backend,
        gemm=FLAGS.gemm, probs_in=FLAGS.probs_in, ep_ranks=FLAGS.ep_ranks, steps=FLAGS.steps,
        check_tokens=FLAGS.check_tokens, profile=FLAGS.profile, seed=FLAGS.seed)


def report_dict(cfg: MoEConfig, rep: Report) -> dict[str, Any]:
    return {"config": dataclasses.asdict(cfg), "platform": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "ok": rep.ok, "errors": rep.errors, "tolerance": rep.tolerance,
            "backend": rep.backend, "gemm": rep.gemm, "checked_tokens": rep.checked_tokens,
            "checked_experts": rep.checked_experts, "step_ms": rep.step_ms, "step_ms_min_max": rep.step_ms_spread,
            "gemm_limit_ms": rep.gemm_limit_ms, "step_over_gemm_limit": rep.step_over_gemm_limit,
            "gemm_tflop_per_step": rep.gemm_tflops, "profile": rep.profile,
            "shapes": {k: list(v) for k, v in rep.shapes.items()}}


def print_report(cfg: MoEConfig, rep: Report) -> None:
    print(f"MoE layer ({cfg.preset}): T={cfg.tokens} H={cfg.hidden} F={cfg.ffn} E={cfg.experts} k={cfg.topk} "
          f"dtype={cfg.dtype} align_size={cfg.align_size} probs_in={cfg.probs_in} ep_ranks={cfg.ep_ranks}")
    print(f"platform={jax.default_backend()} ({jax.devices()[0].device_kind}) te_jax_perm backend={rep.backend} "
          f"grouped GEMM={rep.gemm}")
    for name, shape in rep.shapes.items():
        print(f"  {name:20s} {shape}")
    print(f"  checked against the dense reference on {rep.checked_tokens} of {cfg.tokens} tokens; weight "
          f"gradients on experts {rep.checked_experts if len(rep.checked_experts) <= 8 else 'all'}")
    for name, err in rep.errors.items():
        flag = "ok" if err <= rep.tolerance else "MISMATCH"
        print(f"  max err {name:12s} {err:.3e}  (tol {rep.tolerance:.0e}, relative to max |ref|) {flag}")
    steps = max(1, cfg.steps)
    print(f"  train step (fwd+bwd, jitted): median {rep.step_ms:.2f} ms "
          f"[min {rep.step_ms_spread[0]:.2f}, max {rep.step_ms_spread[1]:.2f}] over {steps} steps")
    print(f"  GEMM limit (dense SwiGLU FFN, same {rep.gemm_tflops:.2f} TFLOP per step): {rep.gemm_limit_ms:.2f} ms "
          f"({rep.gemm_tflops / rep.gemm_limit_ms * 1e3:.0f} TFLOP/s); layer at "
          f"{rep.gemm_tflops / rep.step_ms * 1e3:.0f} TFLOP/s; step / GEMM limit = {rep.step_over_gemm_limit:.2f}")
    if rep.profile is None:
        print("  kernel-time profile: GPU only (this run is on " + jax.default_backend() + ")")
    elif "error" in rep.profile:
        print(f"  kernel-time profile unavailable: {rep.profile['error']}")
    else:
        p = rep.profile
        print(f"  profile: {p['kernel_ms_per_step']:.2f} ms of GPU kernels per step; te_jax_perm kernels "
              f"{p['ours_ms_per_step']:.2f} ms = {100 * p['ours_share_of_kernel_time']:.1f}% of kernel time, "
              f"{100 * p['ours_ms_per_step'] / rep.step_ms:.1f}% of the step")
        for name, ms in list(p["top_kernels_ms_per_step"].items())[:8]:
            print(f"    {ms:8.3f} ms  {name[:100]}")
    if jax.default_backend() == "cpu" and rep.backend != "interpret":
        print("  hint: --backend=interpret runs te_jax_perm's Triton kernels on the CPU interpreter "
              "(slow: try it with --tokens=32 --hidden=32)")
    print("PASS" if rep.ok else "FAIL: MoE layer does not match the dense reference")


def main(argv: list[str]) -> int:
    del argv
    cfg = config_from_flags()
    rep = run_example(cfg)
    cfg = dataclasses.replace(cfg, backend=rep.backend, gemm=rep.gemm)
    print_report(cfg, rep)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(report_dict(cfg, rep), f, indent=1)
    if not rep.ok:
        logging.error("mismatch against the dense reference: %s", rep.errors)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
