"""The whole MoE layer, trained one step at a time: te_jax_perm's dispatch/combine against a
MaxText-style pure-JAX permutation, both around the same grouped GEMM, and the GEMM limit.

    python3 -m benchmarks.layer_bench --out DIR [--budget-s 420] [--shapes DeepSeek,Qwen3]

Per shape, fwd+bwd step time (jitted ``value_and_grad`` of a loss through router, dispatch,
SwiGLU experts and combine) and the step's peak memory (XLA's buffer assignment: arguments,
outputs and temporaries) of the variants below. A step's time (``<name>_ms``) is that of
steps enqueued back to back, as a training loop runs them: the host prepares a step while
the device runs the one before. ``<name>_blocking_ms`` is the time of a call waited for,
which adds the host's time before the device starts (about 0.4-0.9 ms at these sizes on an
H100 host) to every step. The variants and the GEMM limit are timed in turns
(``benchmarks.timing.interleaved_ms``), so that their ratios are taken at the same GPU clock.

* ``ours``: ``token_dispatch`` -> grouped GEMM experts -> ``token_combine`` (the layer of
  ``examples/moe_permute.py``, imported from it);
* ``fused``: the same layer as one ``moe_ffn`` (dispatch and combine fused into the expert
  GEMMs: no dispatched copy of the tokens kept for the backward; on Hopper the first GEMM
  reads rows moved into place just before it);
* ``pure_jax``: the permutation as MaxText writes it: ``argsort`` of the flattened expert
  choices, a gather of the replicated tokens, the same grouped GEMM, the inverse gather and
  a weighted sum over the k copies; the gathers' VJP is the gather by the inverse
  permutation (no scatter-add);
* ``gemm_limit``: a dense SwiGLU FFN over ``T*k`` rows with the same GEMM FLOPs, so
  ``<variant>_over_gemm_limit`` says how close the layer is to its matmuls;
* ``batched_gemm``: the layer's six GEMMs alone (a SwiGLU FFN, fwd+bwd, on the layer's
  weights) as XLA's batched dot over ``E`` groups of ``T*k/E`` rows each: uniform groups
  and no routing or permutation, the easiest grouped problem for the vendor's GEMM
  (cuBLAS on a GPU). ``batched_gemm_over_<limit>`` says how far the limit is from what that
  GEMM reaches; shapes whose ``T*k`` is no multiple of ``E`` leave it out;
* ``roofline``: the larger of the GEMM limit (the step's FLOPs at the dense rate) and the
  bytes its six GEMMs must move (each operand read once, each result written once, every
  expert's weights included) at the device copy's bandwidth measured in the same run: at
  256 experts the weights, not the FLOPs, can bound the step.

Before timing, the loss and every gradient of ``ours`` and ``fused`` are checked against
``pure_jax`` (the same function, permuted another way) at the full size. With ``--profile``
(GPU), a profile of six of each variant's steps enqueued back to back (``ours_profile``,
``fused_profile``, ``pure_jax_profile``; the variants in turns, four rounds, the order
reversed every other round, the median of the last three reported: a GPU that has just run
the timing loop runs slower for a while, and its clocks move a step's kernel time by a few
percent from round to round) gives its kernel time per step on a GPU as hot as a training
loop keeps it, how long at least one kernel ran (``busy_ms_per_step``: below the kernel
time where independent kernels ran at the same time) and from the first kernel's start to
the last one's end (``span_ms_per_step``: the rest is the device idle between kernels), the share spent in
te_jax_perm's kernels, its costliest kernels and the device's longest idle stretches
between kernels; with it, each pure-JAX TARGET line also says the speed-up a permutation
costing nothing would give with the same GEMM (the step less our permutation kernels'
time), and for the unfused layer the speed-up were its permutation to move its least bytes
(``permutation_bytes``: 4T + 5T*k rows of H a step) at the copy's rate, which bounds what
any unfused permutation can reach; and the two steps' ratio in kernel time. A miss reads
``OUT OF REACH`` where no variant's free permutation would reach the target either (the
pure-JAX step shares everything else, so no permutation, fused or not, gets there with
this GEMM).

After the layers, a grouped-GEMM table: our Triton grouped GEMM vs tokamax's (where
installed) vs one dense dot of the same FLOPs, forward and fwd+bwd (``jax.lax.ragged_dot``,
which XLA:GPU densifies, on CPU), with each GEMM's roofline (FLOPs at the dense dot's
rate, or its bytes, every group's weights included, at the copy bandwidth); one size is
also timed as a single group, and the TARGET lines of its grouped form quote that speed
beside theirs (what the kernel's tiles reach with no group boundary). Its shapes,
operands and dense dot are ``benchmarks/gemm_problems.py``'s, shared with
``benchmarks/grouped_gemm_bench.py``.

Targets (H100): the step within 1.25x the GEMM limit at Qwen3 and Mixtral and 1.3x the
roofline at DeepSeek-V3, and 1.1x faster than the pure-JAX permutation at all three; the
grouped GEMM at 0.9x the dense speed forward and 0.85x forward+backward at G <= 32, and
within 1.2x its roofline at G = 256.

Writes ``DIR/layer.json``, ``DIR/layer.png`` and ``DIR/layer.log``. On a CPU (or with
``--mode cpu``) it runs a smoke sweep of tiny shapes: it checks the plumbing, its times mean
nothing, and it prints no target verdicts.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import pathlib
import pkgutil
import platform
import sys
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import gemm_problems, trace_stats
from benchmarks.gemm_problems import GemmShape
from benchmarks.results_io import write_json
from benchmarks.shapes import by_name
from benchmarks.timing import interleaved_ms, median_wall_ms
from examples import moe_permute as example
from te_jax_perm.core import resolve_backend
from te_jax_perm.ops.grouped_gemm.api import grouped_matmul, tokamax_available
from te_jax_perm.workloads import DEEPSEEK_V3, MIXTRAL_8X7B, QWEN3_235B

# Targets (H100): the step over its limit, by model name as the rows carry it (the GEMM
# limit, or for DeepSeek-V3, whose 256 experts' weights can outweigh its FLOPs, the
# roofline); the speed-up over the pure-JAX permutation; the grouped GEMM against the dense
# dot and its roofline.
TARGET_STEP = {QWEN3_235B.name: ("gemm_limit", 1.25), MIXTRAL_8X7B.name: ("gemm_limit", 1.25),
               DEEPSEEK_V3.name: ("roofline", 1.3)}
TARGET_OVER_PURE_JAX = 1.1
TARGET_GEMM_SPEED = {"fwd": 0.9, "fwd_bwd": 0.85}     # dense time / grouped time, at G <= 32
TARGET_GEMM_MANY_GROUPS = (256, 1.2)                  # at G >= 256: grouped fwd time / roofline
VARIANTS = ("ours", "fused")


@dataclasses.dataclass(frozen=True)
class LayerShape:
    model: str
    T: int
    H: int
    F: int
    E: int
    k: int

    @property
    def name(self) -> str:
        return f"{self.model}/T{self.T}/H{self.H}/F{self.F}/E{self.E}/k{self.k}"


GPU_SHAPES = tuple(LayerShape(m.name, 8192, m.H, m.F, m.E, m.k) for m in (DEEPSEEK_V3, QWEN3_235B, MIXTRAL_8X7B))
CPU_SHAPES = (
    LayerShape("smoke", 64, 32, 64, 8, 2),
    LayerShape("smoke", 37, 16, 32, 4, 3),
)
# The grouped-GEMM table, bf16: the sizes where lax.ragged_dot was measured densifying, the
# first of them as one group (what the kernel reaches with no group boundary), and the first
# expert GEMM of the DeepSeek-V3 layer (gate and up: N = 2F).
GPU_GEMMS = gemm_problems.named("g1_16384x4096x4096", "g8_16384x4096x4096", "g32_32768x4096x2048",
                                "g32_65536x7168x2048", "deepseek_v3_up_T8192")
CPU_GEMMS = gemm_problems.CPU_SHAPES


# -- the layer's limits -----------------------------------------------------------------
def layer_gemm_flops(cfg: example.MoEConfig) -> float:
    """GEMM FLOPs of one training step: forward 2*M*H*2F + 2*M*F*H, backward twice that (M = T*k)."""
    m = cfg.tokens * cfg.topk
    return 3 * (2 * m * cfg.hidden * 2 * cfg.ffn + 2 * m * cfg.ffn * cfg.hidden)


def permutation_bytes(cfg: example.MoEConfig) -> float:
    """Bytes the unfused layer's permutation must move at least in one training step, over
    N = T*k dispatched rows of H: dispatch reads T rows and writes N; combine reads N and
    writes T; their backwards move the same the other way, and the combine backward also
    reads the N forward rows for the probability gradient (maps and probabilities left out)."""
    t, n = cfg.tokens, cfg.tokens * cfg.topk
    return (4 * t + 5 * n) * cfg.hidden * jnp.dtype(cfg.dtype).itemsize


def layer_gemm_bytes(cfg: example.MoEConfig) -> float:
    """Bytes the step's six GEMMs must move at least: each operand read once and each result
    written once (forward, input gradient and weight gradient of both expert GEMMs), every
    expert's weights included."""
    m, h, f, e = cfg.tokens * cfg.topk, cfg.hidden, cfg.ffn, cfg.experts
    item = jnp.dtype(cfg.dtype).itemsize
    gemms = ((m * h, e * h * 2 * f, m * 2 * f), (m * f, e * f * h, m * h),            # forward
             (m * h, e * f * h, m * f), (m * 2 * f, e * h * 2 * f, m * h),            # input gradients
             (m * f, m * h, e * f * h), (m * h, m * 2 * f, e * h * 2 * f))            # weight gradients
    return float(item * sum(sum(g) for g in gemms))


def roofline_ms(flop_ms: float, nbytes: float, copy_gbps: float) -> float:
    """The larger of the FLOP time at the dense rate and the bytes at the copy bandwidth."""
    return max(flop_ms, nbytes / (copy_gbps * 1e9) * 1e3)


def copy_bandwidth_gbps(steps: int, nbytes: int, kernel_time: bool) -> float:
    """Read+write GB/s of XLA's elementwise copy of a bf16 buffer of ``nbytes``, timed by the
    profiler's kernel time with ``kernel_time`` (on a GPU: a wall time also holds the launch
    and the host's wait, which at a millisecond's copy reads as a copy up to half as fast and
    so a roofline up to twice as loose), else by wall time."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    one = jnp.ones((), jnp.bfloat16)
    scale = jax.jit(lambda a, s: a * s)
    if kernel_time:
        jax.block_until_ready(scale(x, one))
        ms = trace_stats.profile(lambda: jax.block_until_ready(scale(x, one)), steps).kernel_us_per_step / 1e3
    else:
        ms = median_wall_ms(scale, (x, one), steps)
    return 2 * x.size * 2 / (ms * 1e-3) / 1e9


def peak_gib(jitted: Callable, *args) -> float:
    """The step's peak device memory in XLA's buffer assignment (arguments, outputs and
    temporaries; donated or aliased buffers counted once), GiB."""
    mem = jitted.lower(*args).compile().memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
             - mem.alias_size_in_bytes)
    return total / 2**30


def ffn_loss_and_grads(dtype: Any) -> Callable:
    """jit of the value and the three gradients of a mean-square loss of the SwiGLU FFN
    ``swiglu(rows @ w_in) @ w_out``: one dense FFN, or with a leading group axis on all three
    operands, one per group as batched dots."""
    def loss(rows, w_in, w_out):
        y = example.swiglu(rows @ w_in).astype(dtype) @ w_out
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def dense_ffn_step(cfg: example.MoEConfig) -> tuple[Callable, tuple]:
    """The GEMM limit: one dense SwiGLU FFN over T*k rows with one expert's weights, fwd+bwd:
    the same GEMM FLOPs as the layer with no routing, permutation or grouping."""
    kx, k1, k2 = jax.random.split(jax.random.key(cfg.seed + 1), 3)
    dt = jnp.dtype(cfg.dtype)
    rows = gemm_problems.random_normal(kx, (cfg.tokens * cfg.topk, cfg.hidden), dt)
    w_in = gemm_problems.random_normal(k1, (cfg.hidden, 2 * cfg.ffn), dt, scale=1 / np.sqrt(cfg.hidden))
    w_out = gemm_problems.random_normal(k2, (cfg.ffn, cfg.hidden), dt, scale=1 / np.sqrt(cfg.ffn))
    return ffn_loss_and_grads(dt), (rows, w_in, w_out)


def batched_gemm_step(cfg: example.MoEConfig, params: dict) -> tuple[Callable, tuple] | None:
    """The layer's six GEMMs as XLA's batched dot: the SwiGLU FFN, fwd+bwd, on ``params``'
    expert weights (no second copy of them) over ``E`` uniform groups of ``T*k/E`` rows; None
    where ``T*k`` is no multiple of ``E``."""
    rows_total = cfg.tokens * cfg.topk
    if rows_total % cfg.experts:
        return None
    dt = jnp.dtype(cfg.dtype)
    rows = gemm_problems.random_normal(jax.random.key(cfg.seed + 2),
                                       (cfg.experts, rows_total // cfg.experts, cfg.hidden), dt)
    return ffn_loss_and_grads(dt), (rows, params["w_in"], params["w_out"])


# The ops whose kernels are the expert GEMMs'; every other kernel is the permutation's.
GEMM_OPS = ("grouped_gemm", "moe_ffn")


def gemm_kernel_modules() -> set[str]:
    """The kernel modules the expert GEMMs' declarations launch from (read from the
    declarations, so a kernel added to those ops is counted with them)."""
    from te_jax_perm.core import KernelPrimitive
    modules = set()
    for op in GEMM_OPS:
        decls = importlib.import_module(f"te_jax_perm.ops.{op}.decl")
        modules |= {v.decl.kernel.fn.__module__ for v in vars(decls).values() if isinstance(v, KernelPrimitive)}
    return modules


def our_kernel_names(gemm: bool | None = None) -> list[str]:
    """The names of te_jax_perm's Triton kernels (GPU kernel events carry these names): all
    of them, or only the expert GEMMs' (``gemm=True``) or only the permutation's (``False``)."""
    import te_jax_perm.kernels as kernels_pkg
    gemm_modules = gemm_kernel_modules()
    names = []
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        mod_name = f"te_jax_perm.kernels.{info.name}"
        if gemm is not None and (mod_name in gemm_modules) != gemm:
            continue
        mod = importlib.import_module(mod_name)
        names += [obj.fn.__name__ for obj in vars(mod).values()
                  if callable(getattr(obj, "fn", None)) and getattr(obj.fn, "__module__", "") == mod.__name__]
    return sorted(names)


def kernel_share(step: Callable, args: tuple, steps: int = 6) -> dict[str, Any]:
    """GPU kernel time per step from a profile, and the part of it in te_jax_perm's kernels."""
    jax.block_until_ready(step(*args))
    # Back to back, as a training loop runs: kernels of a hot GPU, and the idle time between steps.
    stats = trace_stats.profile(lambda: step(*args), steps, back_to_back=True)
    ours, permutation = our_kernel_names(), our_kernel_names(gemm=False)
    ours_ns = sum(ns for k, ns in stats.kernel_ns.items() if trace_stats.matches(k, ours))
    permutation_ns = sum(ns for k, ns in stats.kernel_ns.items() if trace_stats.matches(k, permutation))
    total = sum(stats.kernel_ns.values())
    if total == 0:
        raise RuntimeError("the profile holds no GPU kernel events")
    top = sorted(stats.kernel_ns.items(), key=lambda kv: -kv[1])[:8]
    return {"kernel_ms_per_step": stats.kernel_us_per_step / 1e3, "busy_ms_per_step": stats.busy_us_per_step / 1e3,
            "span_ms_per_step": stats.span_us_per_step / 1e3, "kernels_per_step": stats.kernels_per_step,
            "ours_ms_per_step": ours_ns / steps / 1e6,
            "ours_share_of_kernel_time": ours_ns / total, "permutation_ms_per_step": permutation_ns / steps / 1e6,
            "top_kernels_ms_per_step": {k: v / steps / 1e6 for k, v in top},
            "largest_gaps_us": stats.gaps_json()}


def profiles_in_turns(steps_by_name: dict[str, Callable], args: tuple, rounds: int = 4) -> dict[str, Any]:
    """``{name}_profile`` per step: ``kernel_share`` taken in turns (every step once a round,
    the order reversed every other round), reporting the round of median kernel time after
    the first. Right after the timing loop the GPU runs slower for a while (on an H100 at
    Qwen3-235B's layer, the first profile of a round took 1.4 ms a step more than the same
    step's in the next round), so the first round only settles it; after it, the same step's
    kernel time still moved by up to 4% from round to round on an H100 (its clocks follow
    its power and temperature), so one round is no measure and no step always goes first.
    Each round's kernel time stays in ``kernel_ms_per_step_rounds``."""
    taken: dict[str, list[dict[str, Any]]] = {name: [] for name in steps_by_name}
    errors: dict[str, str] = {}
    names = list(steps_by_name)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            if name in errors:
                continue
            try:
                taken[name].append(kernel_share(steps_by_name[name], args))
            except Exception as e:  # noqa: BLE001 - the row says why instead of failing the run
                errors[name] = f"{type(e).__name__}: {e}"
    out = {}
    for name, got in taken.items():
        if name in errors:
            out[f"{name}_profile"] = {"error": errors[name]}
            continue
        kept = sorted(got[1:] or got, key=lambda g: g["kernel_ms_per_step"])
        out[f"{name}_profile"] = {**kept[(len(kept) - 1) // 2],
                                  "kernel_ms_per_step_rounds": [g["kernel_ms_per_step"] for g in got]}
    return out


# -- the MaxText-style permutation ----------------------------------------------------------
@jax.custom_vjp
def sort_rows(x: jax.Array, order: jax.Array) -> jax.Array:
    """``x[order]`` for a permutation ``order``; its VJP gathers by the inverse permutation."""
    return jnp.take(x, order, axis=0)


def _sort_rows_fwd(x, order):
    return sort_rows(x, order), order


def _sort_rows_bwd(order, g):
    return sort_rows(g, jnp.argsort(order)), None


sort_rows.defvjp(_sort_rows_fwd, _sort_rows_bwd)


def pure_jax_layer(params: dict[str, jax.Array], x: jax.Array, cfg: example.MoEConfig) -> jax.Array:
    """The same layer as ``example.moe_layer``, permuted by argsort and gathers (MaxText's way)."""
    t, h = x.shape
    logits = x.astype(jnp.float32) @ params["router"]
    top_logits, top_idx = jax.lax.top_k(logits, cfg.topk)
    weights = jax.nn.softmax(top_logits, axis=-1)                       # [T, k]
    flat = top_idx.reshape(-1)
    order = jnp.argsort(flat)
    rows = sort_rows(jnp.repeat(x, cfg.topk, axis=0), order)            # [T*k, H] grouped by expert
    group_sizes = jnp.bincount(flat, length=cfg.experts).astype(jnp.int32)
    y = example.expert_ffn(params, rows, group_sizes, cfg.gemm)
    back = sort_rows(y, jnp.argsort(order)).reshape(t, cfg.topk, h)
    return jnp.einsum("tkh,tk->th", back.astype(jnp.float32), weights).astype(x.dtype)


# -- measurements -------------------------------------------------------------------------
class Log:
    def __init__(self, path: pathlib.Path | None):
        self.path = path

    def __call__(self, msg: str) -> None:
        print(msg, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(msg + "\n")


# ``mm(lhs, rhs) -> out``: one GEMM of the table.
MatMul = Callable[[jax.Array, jax.Array], jax.Array]


def loss_and_grads(mm: MatMul) -> Callable:
    """jit of the value and both gradients of a mean-square loss of ``mm(lhs, rhs)``: the
    GEMM table's fwd+bwd, three GEMMs (the forward, the input and the weight gradient)."""
    return jax.jit(jax.value_and_grad(lambda a, b: jnp.mean(jnp.square(mm(a, b).astype(jnp.float32))), (0, 1)))


def gemm_cases(group_sizes: jax.Array, backends: tuple[str, ...]) -> dict[str, MatMul]:
    """``mm(lhs, rhs)`` of the grouped GEMM on each of ``backends`` over ``group_sizes`` (``rhs``:
    ``Operands.rhs``), and ``"dense"``, the dense dot (``rhs``: ``Operands.dense_rhs``)."""
    cases = {b: (lambda x, w, b=b: grouped_matmul(x, w, group_sizes, backend=b)) for b in backends}
    cases["dense"] = gemm_problems.dense_dot
    return cases


def gemm_row(shape: GemmShape, dtype: str, backends: tuple[str, ...], steps: int, profile: bool = True) -> dict:
    """Forward and fwd+bwd (:func:`loss_and_grads`) times of the grouped GEMM on each of
    ``backends`` and of the dense dot of the same FLOPs: wall time (``*_ms``) and, with
    ``profile``, the profiler's kernel time per call (``*_kernel_ms``), which the targets
    use: a wall time of a few milliseconds moved by up to 20% between runs of the same code."""
    ops = gemm_problems.operands(shape, dtype)
    row: dict[str, Any] = {"name": shape.name, "M": shape.M, "K": shape.K, "N": shape.N, "G": shape.G,
                           "dtype": dtype, "tflop_fwd": shape.flops / 1e12, "bytes_fwd": shape.bytes_fwd(dtype)}
    for name, mm in gemm_cases(ops.group_sizes, backends).items():
        rhs = ops.dense_rhs if name == "dense" else ops.rhs
        for what, fn, gemms in (("fwd", jax.jit(mm), 1), ("fwd_bwd", loss_and_grads(mm), 3)):
            try:
                ms = median_wall_ms(fn, (ops.lhs, rhs), steps)
                row[f"{name}_{what}_ms"] = ms
                row[f"{name}_{what}_tflops"] = shape.tflops(ms, gemms)
                if profile:
                    stats = trace_stats.profile(lambda fn=fn, rhs=rhs: jax.block_until_ready(fn(ops.lhs, rhs)), 3)
                    row[f"{name}_{what}_kernel_ms"] = stats.kernel_us_per_step / 1e3
            except Exception as e:  # noqa: BLE001 - e.g. out of memory for the densified ragged_dot
                row[f"{name}_{what}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


def _max_rel_diff(a: Any, b: Any, chunk: int = 1 << 24) -> float:
    """Largest difference over every leaf, relative to the largest value of ``b``; on the
    host, in float32 chunks, so that comparing two sets of gradients as large as the
    experts' weights needs no device memory beside the step's own."""
    diff = scale = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x).reshape(-1), np.asarray(y).reshape(-1)
        for i in range(0, x.size, chunk):
            xs, ys = x[i:i + chunk].astype(np.float32), y[i:i + chunk].astype(np.float32)
            diff = max(diff, float(np.max(np.abs(xs - ys))))
            scale = max(scale, float(np.max(np.abs(ys))))
    return diff / max(scale, 1e-6)


def layer_row(shape: LayerShape, dtype: str, backend: str | None, gemm: str, steps: int,
              profile: bool = False, copy_gbps: float | None = None) -> dict:
    gemm = resolve_backend(None) if gemm == "auto" else gemm   # grouped_matmul's default for float operands
    cfg = example.MoEConfig(tokens=shape.T, hidden=shape.H, ffn=shape.F, experts=shape.E, topk=shape.k, dtype=dtype,
                            backend=resolve_backend(backend), gemm=gemm)
    fused = dataclasses.replace(cfg, gemm="fused")
    kp, kx = jax.random.split(jax.random.PRNGKey(0))
    params = jax.jit(example.init_params, static_argnums=0)(cfg, kp)   # jitted: no float32 temporaries
    x = gemm_problems.random_normal(kx, (cfg.tokens, cfg.hidden), dtype)

    def step_of(layer):
        loss = lambda p, x: jnp.mean(jnp.square(layer(p, x).astype(jnp.float32)))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    steps_by_name = {"ours": step_of(lambda p, x: example.moe_layer(p, x, cfg)),
                     "fused": step_of(lambda p, x: example.moe_layer(p, x, fused)),
                     "pure_jax": step_of(lambda p, x: pure_jax_layer(p, x, cfg))}
    row: dict[str, Any] = {"shape": shape.name, **dataclasses.asdict(shape), "dtype": dtype,
                           "backend": cfg.backend, "gemm": cfg.gemm, "gemm_tflop_per_step": layer_gemm_flops(cfg) / 1e12,
                           "gemm_bytes_per_step": layer_gemm_bytes(cfg),
                           "permutation_bytes_per_step": permutation_bytes(cfg)}
    for name, step in steps_by_name.items():
        try:
            row[f"{name}_peak_gib"] = peak_gib(step, params, x)
        except Exception as e:  # noqa: BLE001 - e.g. a buffer assignment that cannot fit the device
            row[f"{name}_peak_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    # Same function, permuted other ways: the loss and every gradient must agree before times mean anything.
    want, timed = None, {}
    for name in ("pure_jax", *VARIANTS):
        try:
            got = jax.device_get(steps_by_name[name](params, x))
            if want is None:
                want = got
            else:
                row[f"{name}_vs_pure_jax_max_rel_diff"] = _max_rel_diff(got, want)
            del got
            timed[name] = (steps_by_name[name], (params, x))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the row says so, the others go on
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    del want
    timed["gemm_limit"] = dense_ffn_step(cfg)
    batched = batched_gemm_step(cfg, params)
    if batched is not None:
        timed["batched_gemm"] = batched
    try:
        # In turns: a ratio of two steps is taken at the same GPU clock (timing.interleaved_ms).
        for name, (b2b, waited) in interleaved_ms(timed, steps).items():
            row[f"{name}_ms"], row[f"{name}_blocking_ms"] = b2b, waited
    except Exception as e:  # noqa: BLE001 - the row says why instead of failing the run
        for name in timed:
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if profile:
        row.update(profiles_in_turns({n: steps_by_name[n] for n in (*VARIANTS, "pure_jax") if n in timed},
                                     (params, x)))
    del params, x, timed
    if copy_gbps:
        row["roofline_ms"] = roofline_ms(row["gemm_limit_ms"], row["gemm_bytes_per_step"], copy_gbps)
        row["roofline_blocking_ms"] = roofline_ms(row["gemm_limit_blocking_ms"], row["gemm_bytes_per_step"], copy_gbps)
    for name in ("batched_gemm", *VARIANTS):
        if f"{name}_ms" in row:
            for limit in ("gemm_limit", "roofline"):
                if f"{limit}_ms" in row:
                    row[f"{name}_over_{limit}"] = row[f"{name}_ms"] / row[f"{limit}_ms"]
            if "pure_jax_ms" in row and name in VARIANTS:
                row[f"pure_jax_over_{name}"] = row["pure_jax_ms"] / row[f"{name}_ms"]
                row.update(permutation_bounds(row, name, copy_gbps))
    return row


def permutation_bounds(row: dict, name: str, copy_gbps: float | None) -> dict:
    """How fast, against the pure-JAX layer, variant ``name`` could be with the same GEMM
    where its profile measured its permutation kernels: were they to take no time
    (``pure_jax_over_<name>_free_permutation``) and, for the unfused layer, were they to move
    their least bytes (:func:`permutation_bytes`) at the copy's rate, the most any unfused
    permutation can do (``pure_jax_over_ours_permutation_at_floor``)."""
    perm = row.get(f"{name}_profile", {}).get("permutation_ms_per_step")
    if perm is None:
        return {}
    rest_ms = row[f"{name}_ms"] - perm
    out = {f"pure_jax_over_{name}_free_permutation": row["pure_jax_ms"] / rest_ms}
    if name == "ours" and copy_gbps:
        floor = row["permutation_bytes_per_step"] / (copy_gbps * 1e9) * 1e3
        out.update(permutation_floor_ms=floor, pure_jax_over_ours_permutation_at_floor=row["pure_jax_ms"] /
                   (rest_ms + floor))
    return out


def _verdict(ok: bool, what: str, out_of_reach: bool = False) -> str:
    """A TARGET line: PASS, FAIL, or OUT OF REACH for a miss that the line's own figures show
    no implementation could avoid."""
    return f"TARGET {'PASS' if ok else 'OUT OF REACH' if out_of_reach else 'FAIL'} {what}"


def verdicts(rows: list[dict]) -> list[str]:
    """One TARGET line per layer variant and target (the step over the model's limit, the
    speed-up over the pure-JAX permutation), then per grouped GEMM of the table."""
    lines = []
    for r in (r for r in rows if "shape" in r):
        target = TARGET_STEP.get(r["model"])
        # The most any variant's free permutation would give with the same GEMM: below the
        # target, no permutation (fused or not) reaches it, since the pure-JAX step shares
        # everything else.
        bounds = [r[f"pure_jax_over_{n}_free_permutation"] for n in VARIANTS
                  if f"pure_jax_over_{n}_free_permutation" in r]
        best_bound = max(bounds) if bounds else None
        for name in VARIANTS:
            if f"{name}_ms" not in r:
                if f"{name}_error" in r:
                    lines.append(_verdict(False, f"{r['shape']} {name}: did not run ({r[f'{name}_error'][:120]})"))
                continue
            if target and f"{name}_over_{target[0]}" in r:
                ratio = r[f"{name}_over_{target[0]}"]
                lines.append(_verdict(ratio <= target[1], f"{r['shape']} {name}: step / {target[0].replace('_', ' ')} "
                                      f"{ratio:.2f} ({r[f'{name}_ms']:.2f} / {r[f'{target[0]}_ms']:.2f} ms; "
                                      f"target <= {target[1]}){_waited(r, name, target[0])}"
                                      f"{_ratio(BATCHED_LABEL, r.get('batched_gemm_ms'), r[f'{target[0]}_ms'])}"))
            if f"pure_jax_over_{name}" in r:
                ratio = r[f"pure_jax_over_{name}"]
                bound = r.get(f"pure_jax_over_{name}_free_permutation")
                reach = "" if bound is None else (
                    f"; {bound:.2f}x were te_jax_perm's permutation kernels "
                    f"({r[f'{name}_profile']['permutation_ms_per_step']:.2f} ms of kernel time) to take none")
                if bound is not None and f"pure_jax_over_{name}_permutation_at_floor" in r:
                    reach += (f", {r[f'pure_jax_over_{name}_permutation_at_floor']:.2f}x were they to move their "
                              f"{r['permutation_bytes_per_step'] / 1e9:.2f} GB at the copy's rate "
                              f"({r['permutation_floor_ms']:.2f} ms)")
                out_of_reach = (ratio < TARGET_OVER_PURE_JAX and best_bound is not None
                                and best_bound < TARGET_OVER_PURE_JAX)
                if out_of_reach and best_bound != bound:
                    reach += f"; at most {best_bound:.2f}x with any variant's permutation free"
                lines.append(_verdict(ratio >= TARGET_OVER_PURE_JAX,
                                      f"{r['shape']} {name}: {r[f'{name}_ms']:.2f} ms vs pure-JAX permutation "
                                      f"{r['pure_jax_ms']:.2f} ms ({ratio:.2f}x{reach}; target >= "
                                      f"{TARGET_OVER_PURE_JAX}){_waited(r, 'pure_jax', name)}"
                                      f"{_in_kernel_time(r, 'pure_jax', name)}", out_of_reach))
    return lines


# How the step targets' lines name the batched-dot step: what the vendor's GEMM reaches
# on the easiest form of the layer's GEMMs, beside the limit the target holds the layer to.
BATCHED_LABEL = "the six GEMMs alone as XLA's batched dot at uniform group sizes"


def _ratio(label: str, a_ms: float | None, b_ms: float | None) -> str:
    """``"; label: a / b ms = a/b"``, or nothing where either time is missing."""
    return "" if a_ms is None or b_ms is None else f"; {label}: {a_ms:.2f} / {b_ms:.2f} ms = {a_ms / b_ms:.2f}"


def _in_kernel_time(r: dict, a: str, b: str) -> str:
    """The ratio ``a / b`` of the two steps' kernel time from their profiles (taken in turns),
    where the row has both: the ratio at one GPU clock, without the host."""
    return _ratio("kernel time", r.get(f"{a}_profile", {}).get("kernel_ms_per_step"),
                  r.get(f"{b}_profile", {}).get("kernel_ms_per_step"))


def _waited(r: dict, a: str, b: str) -> str:
    """The same ratio ``a / b`` over calls each waited for, where the row has both."""
    return _ratio("calls waited for", r.get(f"{a}_blocking_ms"), r.get(f"{b}_blocking_ms"))


def gemm_verdicts(rows: list[dict], backend: str = "triton") -> list[str]:
    """The grouped GEMM (on ``backend``) against the dense dot of the same FLOPs at G <= 32, and
    against its roofline at many groups."""
    lines = []
    many, limit = TARGET_GEMM_MANY_GROUPS
    one_group = {(r["M"], r["K"], r["N"]): r for r in rows if r["G"] == 1}
    for r in rows:
        name = f"grouped GEMM M={r['M']} K={r['K']} N={r['N']} G={r['G']}"
        if r["G"] >= many:
            ours, roof, how = _times(r, f"{backend}_fwd", "roofline_fwd")
            if ours is not None:
                ratio = ours / roof
                lines.append(_verdict(ratio <= limit, f"{name} fwd: {ours:.3f} ms / roofline {roof:.3f} ms "
                                      f"= {ratio:.2f}{how} (target <= {limit})"))
            continue
        for what, want in TARGET_GEMM_SPEED.items():
            ours, dense, how = _times(r, f"{backend}_{what}", f"dense_{what}")
            if ours is not None:
                speed = dense / ours
                # Beside it, the same kernel on one group of the same size, where measured:
                # how much of the gap the groups make and how much the kernel's own tiles.
                single = one_group.get((r["M"], r["K"], r["N"])) if r["G"] > 1 else None
                ours1, dense1, _ = _times(single or {}, f"{backend}_{what}", f"dense_{what}")
                alone = "" if ours1 is None else f"; on one group {dense1 / ours1:.2f}x"
                lines.append(_verdict(speed >= want, f"{name} {what}: {speed:.2f}x the dense speed "
                                      f"({ours:.3f} vs {dense:.3f} ms{how}{alone}; target >= {want})"))
    return lines


def _times(r: dict, a: str, b: str) -> tuple[float | None, float | None, str]:
    """``(a, b, how)``: the kernel times of ``a`` and ``b`` where the row has both (``how``
    says so and quotes the wall times), else their wall times, else Nones."""
    if f"{a}_kernel_ms" in r and f"{b}_kernel_ms" in r:
        return r[f"{a}_kernel_ms"], r[f"{b}_kernel_ms"], f" in kernel time; wall {r[f'{a}_ms']:.3f} vs {r[f'{b}_ms']:.3f} ms"
    if f"{a}_ms" in r and f"{b}_ms" in r:
        return r[f"{a}_ms"], r[f"{b}_ms"], ""
    return None, None, ""


# -- plot ---------------------------------------------------------------------------------
def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["layers"] if "gemm_limit_ms" in r]
    smoke = result["smoke"]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8.5), gridspec_kw={"height_ratios": [3, 2]})
    labels = [r["shape"].replace("/", "\n", 1) for r in rows]
    xs = np.arange(len(rows))
    series = (("ours_ms", "te_jax_perm dispatch/combine", "tab:blue"),
              ("fused_ms", "te_jax_perm moe_ffn (fused)", "tab:green"),
              ("pure_jax_ms", "pure-JAX permutation (argsort + gather)", "tab:orange"),
              ("batched_gemm_ms", "the GEMMs alone as XLA's batched dot (uniform groups)", "tab:purple"),
              ("gemm_limit_ms", "GEMM limit (dense FFN, same FLOPs)", "tab:gray"),
              ("roofline_ms", "roofline (GEMM limit or operand bytes at copy speed)", "tab:brown"))
    w = 0.14
    for i, (key, label, color) in enumerate(series):
        vals = [r.get(key, np.nan) for r in rows]
        bars = ax1.bar(xs + (i - (len(series) - 1) / 2) * w, vals, w, label=label, color=color)
        ax1.bar_label(bars, labels=[f"{v:.2f}" if np.isfinite(v) else "n/a" for v in vals], fontsize=7, padding=2)
    ax1.set_xticks(xs, labels, fontsize=8)
    ax1.set_ylabel("fwd+bwd step time (ms)")
    ax1.set_title(f"MoE layer training step on {result['device']}, grouped GEMM: "
                  f"{', '.join(sorted({r['gemm'] for r in rows})) or '-'}"
                  + ("  [CPU SMOKE RUN: times not meaningful]" if smoke else ""), fontsize=10)
    ax1.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax1.margins(y=0.15)

    def limit_of(r):
        return TARGET_STEP.get(r["model"], ("gemm_limit", np.nan))

    for i, (name, color) in enumerate((("ours", "tab:blue"), ("fused", "tab:green"))):
        ratio = [r.get(f"{name}_over_{limit_of(r)[0]}", np.nan) for r in rows]
        bars = ax2.bar(xs + (i - 0.5) * 0.3, ratio, 0.3, color=color, label=f"{name} / its limit")
        ax2.bar_label(bars, labels=[f"{v:.2f}x" if np.isfinite(v) else "n/a" for v in ratio], fontsize=8, padding=2)
    if not smoke:
        ax2.scatter(xs, [limit_of(r)[1] for r in rows], marker="_", s=900, color="tab:red",
                    label="target (GEMM limit at Qwen3 and Mixtral, roofline at DeepSeek-V3)")
    ax2.axhline(1.0, color="black", lw=0.8, label="the limit")
    ax2.set_xticks(xs, labels, fontsize=8)
    ax2.set_ylabel("step time / limit")
    ax2.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax2.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for layer.json, layer.png and layer.log")
    ap.add_argument("--mode", choices=("auto", "gpu", "cpu"), default="auto",
                    help="gpu: real shapes (fails without a GPU); cpu: tiny smoke shapes; auto: gpu if there is one")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="stop starting new measurements after this many seconds (the JSON and PNG are still written)")
    ap.add_argument("--shapes", default="", help="comma-separated substrings of the layer shapes to run (default: all)")
    ap.add_argument("--steps", type=int, default=None, help="timed calls per measurement (default: 10 on GPU, 2 on CPU)")
    ap.add_argument("--gemm", choices=("auto", "triton", "interpret", "tokamax", "xla"), default="auto",
                    help="grouped GEMM inside the layers, grouped_matmul's backend "
                         "(auto: triton on a GPU, else xla)")
    ap.add_argument("--no-gemm-table", action="store_true", help="skip the grouped-GEMM table")
    ap.add_argument("--profile", action="store_true",
                    help="profile each layer's step: the share of GPU kernel time in te_jax_perm's kernels (GPU)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps={args.steps} must be at least 1")
    on_gpu = jax.default_backend() == "gpu" and args.mode != "cpu"
    if args.mode == "gpu" and not on_gpu:
        raise SystemExit(f"--mode gpu: JAX sees no GPU (jax.default_backend() is {jax.default_backend()!r})")
    # Every flag is checked before the output directory or the device is touched: a typo in
    # --shapes must not cost the copy measurement (a GiB on a GPU) first.
    shapes = by_name(args.shapes, GPU_SHAPES if on_gpu else CPU_SHAPES)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layer.log").unlink(missing_ok=True)
    log = Log(out / "layer.log")
    steps = args.steps or (10 if on_gpu else 2)
    dtype = "bfloat16" if on_gpu else "float32"
    backend = "triton" if on_gpu else None
    smoke = not on_gpu
    result: dict[str, Any] = {
        "device": jax.devices()[0].device_kind if on_gpu else f"CPU ({platform.machine()})",
        "jax": jax.__version__, "smoke": smoke, "steps": steps, "dtype": dtype,
        "tokamax_available": tokamax_available(), "gemm_table": [], "layers": [], "skipped": [], "targets": [],
        # How JAX holds device memory shapes back-to-back steps: a pool that grows on demand
        # may allocate from the driver mid-loop, which can stall the host between steps.
        "allocator": {k: os.environ[k] for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                 "XLA_PYTHON_CLIENT_ALLOCATOR") if k in os.environ},
    }
    log(f"layer bench on {result['device']}, jax {jax.__version__}, tokamax "
        f"{'available' if result['tokamax_available'] else 'NOT available'}"
        + (f"; {', '.join(f'{k}={v}' for k, v in result['allocator'].items())}" if result["allocator"] else "")
        + ("; CPU SMOKE RUN: tiny shapes, times are not meaningful, no target verdicts" if smoke else ""))
    budget_left = lambda: args.budget_s - (time.perf_counter() - t_start)
    # The copy bandwidth the rooflines use, measured in this run (1 GiB, in kernel time, on a GPU).
    result["copy_GBps"] = copy_bandwidth_gbps(steps, 1 << 30 if on_gpu else 1 << 24, kernel_time=on_gpu)
    log(f"device copy: {result['copy_GBps']:.0f} GB/s (read + write, {'kernel' if on_gpu else 'wall'} time)")

    for shape in shapes:
        if budget_left() < 0:
            result["skipped"].append(f"{shape.name}: budget")
            log(f"LAYER {shape.name}: skipped, the {args.budget_s:.0f} s budget is spent")
            continue
        t0 = time.perf_counter()
        try:
            row = layer_row(shape, dtype, backend, args.gemm, steps, profile=args.profile and on_gpu,
                            copy_gbps=result["copy_GBps"])
        except Exception as e:  # noqa: BLE001 - one shape failing must not lose the others
            row = {"shape": shape.name, **dataclasses.asdict(shape), "error": f"{type(e).__name__}: {e}"[:400]}
            traceback.print_exc()
        result["layers"].append(row)
        if "gemm_limit_ms" in row:
            nan = float("nan")
            parts = [f"{name} {row.get(f'{name}_ms', nan):.2f} ms (waited for {row.get(f'{name}_blocking_ms', nan):.2f}; "
                     f"peak {row.get(f'{name}_peak_gib', nan):.1f} GiB"
                     + (f", agrees to {row[f'{name}_vs_pure_jax_max_rel_diff']:.1e}"
                        if f"{name}_vs_pure_jax_max_rel_diff" in row else "") + ")"
                     for name in (*VARIANTS, "pure_jax")]
            log(f"LAYER {shape.name} [gemm {row['gemm']}, backend {row['backend']}]: " + ", ".join(parts)
                + (f"; the GEMMs alone as XLA's batched dot {row['batched_gemm_ms']:.2f} ms"
                   if "batched_gemm_ms" in row else "")
                + f"; GEMM limit {row['gemm_limit_ms']:.2f} ms (waited for {row['gemm_limit_blocking_ms']:.2f}; "
                f"{row['gemm_tflop_per_step']:.1f} TFLOP), roofline "
                f"{row.get('roofline_ms', nan):.2f} ms ({row['gemm_bytes_per_step'] / 1e9:.1f} GB of GEMM operands) "
                f"({time.perf_counter() - t0:.0f} s)")
            for name in VARIANTS:
                if f"{name}_error" in row:
                    log(f"LAYER {shape.name} {name}: FAILED {row[f'{name}_error'][:300]}")
            for name in (*VARIANTS, "pure_jax"):
                prof = row.get(f"{name}_profile")
                if prof:
                    log(f"PROFILE {shape.name} {name}: " + (f"unavailable: {prof['error']}" if "error" in prof else
                        f"{prof['kernel_ms_per_step']:.2f} ms of GPU kernels per step ({prof['kernels_per_step']:.0f} "
                        f"kernels; {prof['busy_ms_per_step']:.2f} ms with at least one running, of "
                        f"{prof['span_ms_per_step']:.2f} ms from first to last), te_jax_perm's "
                        f"{prof['ours_ms_per_step']:.2f} ms ({100 * prof['ours_share_of_kernel_time']:.1f}%); "
                        + ", ".join(f"{k} {v:.2f}" for k, v in prof["top_kernels_ms_per_step"].items())
                        + "; device idle between kernels, longest: "
                        + ", ".join(f"{g['us']:.0f} µs ({g['after'][:40]} -> {g['before'][:40]})"
                                    for g in prof["largest_gaps_us"][:6])))
        else:
            log(f"LAYER {shape.name}: FAILED {row['error'][:300]}")

    if not args.no_gemm_table:
        # lax.ragged_dot densifies on GPUs (4-30x the dense time, out of memory at DeepSeek-V3
        # sizes), so the GPU table compares the two real grouped GEMMs.
        gemm_backends = (("triton",) + (("tokamax",) if result["tokamax_available"] else ())) if on_gpu else ("xla",)
        for shape in (GPU_GEMMS if on_gpu else CPU_GEMMS):
            m, k, n, g = shape.M, shape.K, shape.N, shape.G
            if budget_left() < 0:
                result["skipped"].append(f"gemm {m}x{k}x{n} G={g}: budget")
                continue
            row = gemm_row(shape, dtype, gemm_backends, steps)
            if "dense_fwd_ms" in row:
                row["roofline_fwd_ms"] = roofline_ms(row["dense_fwd_ms"], row["bytes_fwd"], result["copy_GBps"])
            if "dense_fwd_kernel_ms" in row:
                row["roofline_fwd_kernel_ms"] = roofline_ms(row["dense_fwd_kernel_ms"], row["bytes_fwd"],
                                                            result["copy_GBps"])
            result["gemm_table"].append(row)
            parts = [f"{name} {row[f'{name}_fwd_ms']:.3f} ms ({row[f'{name}_fwd_tflops']:.0f} TFLOP/s)"
                     if f"{name}_fwd_ms" in row else f"{name} {row.get(f'{name}_fwd_error', '?')[:80]}"
                     for name in (*gemm_backends, "dense")]
            log(f"GEMM M={m} K={k} N={n} G={g} fwd: " + "; ".join(parts))
            parts = [f"{name} {row[f'{name}_fwd_bwd_ms']:.3f} ms (kernels {row.get(f'{name}_fwd_bwd_kernel_ms', 0):.3f})"
                     if f"{name}_fwd_bwd_ms" in row
                     else f"{name} failed" for name in (*gemm_backends, "dense")]
            log(f"GEMM M={m} K={k} N={n} G={g} fwd+bwd: " + "; ".join(parts))

    if not smoke:
        result["targets"] = verdicts(result["layers"]) + gemm_verdicts(result["gemm_table"])
        for line in result["targets"]:
            log(line)
    write_json(out / "layer.json", result)
    plot(result, out / "layer.png")
    failed = [r["shape"] for r in result["layers"] if "error" in r or any(f"{n}_error" in r for n in VARIANTS)]
    log(f"LAYER SUMMARY: {len(result['layers'])} shapes measured, {len(failed)} failed, "
        f"{len(result['skipped'])} skipped; wrote {out / 'layer.json'} and {out / 'layer.png'} "
        f"in {time.perf_counter() - t_start:.0f} s" + (" (CPU smoke run)" if smoke else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
