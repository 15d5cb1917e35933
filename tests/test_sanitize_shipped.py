"""Every kernel the library ships, under the hazard sanitizer, must report nothing.

Public ops run forward and backward with ``backend="interpret"`` over a shape sweep
(T=1, odd H, empty experts, skewed routing, dropping, padding, chunk sorts with empty
chunks and unmapped rows); a config sweep then re-runs some scenarios once per distinct
unpruned autotune candidate of the kernels they sweep (``num_warps``/``num_stages`` do
not change what the interpreter runs, so configs differing only in those are one). The
sweep's scenarios together run every config of every kernel's tuning space that some size
admits (a test holds them to it), each config where it costs least: a scenario leaves to
another the kernels that one sweeps, and tiles that fit narrow rows run on narrow rows.
"""
import importlib
import inspect
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax_perm.ops
from te_jax_perm.autotune.tuner import candidates
from te_jax_perm.core import KernelPrimitive, hooks
from te_jax_perm.core.launch import Call
from te_jax_perm.sanitize import sanitize
from tests.conftest import routing

BE = "interpret"


def shipped_kernels() -> dict[str, KernelPrimitive]:
    """Module-level kernel primitives of every ``te_jax_perm.ops`` module and subpackage
    module (each op's ``decl``), by decl name."""
    found = {}
    for mod in pkgutil.walk_packages(te_jax_perm.ops.__path__, "te_jax_perm.ops."):
        m = importlib.import_module(mod.name)
        for _, v in inspect.getmembers(m, lambda v: isinstance(v, KernelPrimitive)):
            found[v.decl.name] = v
    return found


def run_moe(T, H, E, k, mode, *, drop=0, align=None, probs=True, dtype=jnp.float32, seed=0):
    """token_dispatch -> token_combine, forward and backward (all cotangents non-zero)."""
    from te_jax_perm import token_combine, token_dispatch

    rng = np.random.default_rng(seed)
    rm = routing(rng, T, E, k, mode)
    num_out = max(int(rm.sum()) - drop, 0)
    rm = jnp.asarray(rm)
    x = jnp.asarray(rng.standard_normal((T, H)), dtype)
    p = jnp.asarray(rng.random((T, E)), jnp.float32) * rm if probs else None

    def f(x, p):
        out, pp, rid, pad, _ = token_dispatch(x, rm, num_out, probs=p, align_size=align, backend=BE)
        y = token_combine(out, rid, merging_probs=p, pad_offsets=pad, backend=BE)
        return (y, out) if pp is None else (y, out, pp)

    primals, vjp = jax.vjp(f, x, p)
    cts = tuple(jnp.ones_like(v) for v in primals)
    return primals, vjp(cts)


def run_mask_map_inference(T, H, E, k, mode, *, drop=0, seed=0):
    """The map-level ops as an inference step runs them: the map, permute_with_mask_map (its
    own row owner launch) and the weighted unpermute's forward alone (no owner table)."""
    from te_jax_perm import make_row_id_map, permute_with_mask_map, unpermute_with_mask_map

    rng = np.random.default_rng(seed)
    rm = routing(rng, T, E, k, mode)
    num_out = max(int(rm.sum()) - drop, 0)
    rm = jnp.asarray(rm)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    p = jnp.asarray(rng.random((T, E)), jnp.float32) * rm
    rid, tpe = make_row_id_map(rm, num_out, backend=BE)
    out, pp = permute_with_mask_map(x, rid, tpe, num_out, probs=p, backend=BE)
    return out, pp, unpermute_with_mask_map(out, rid, merging_probs=p, backend=BE)


def run_weighted_unpermute(T, H, E, k, mode, *, seed=0):
    """The weighted unpermute's forward alone (an inference step's combine), on rows and a
    map the ``xla`` backend builds: the sweep of its configs runs no other kernel."""
    from te_jax_perm import make_row_id_map, permute_with_mask_map, unpermute_with_mask_map

    rng = np.random.default_rng(seed)
    rm = routing(rng, T, E, k, mode)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    p = jnp.asarray(rng.random((T, E)), jnp.float32) * rm
    rid, tpe = make_row_id_map(jnp.asarray(rm), int(rm.sum()), backend="xla")
    out, _ = permute_with_mask_map(x, rid, tpe, int(rm.sum()), backend="xla")
    return unpermute_with_mask_map(out, rid, merging_probs=p, backend=BE)


def run_chunk_sort(N, H, sizes, order, *, probs=True, seed=0):
    from te_jax_perm import sort_chunks_by_index, sort_chunks_by_index_with_probs

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
    p = jnp.asarray(rng.random(N), jnp.float32) if probs else None

    def f(x, p):
        sizes_, order_ = jnp.asarray(sizes, jnp.int32), jnp.asarray(order, jnp.int32)
        if p is None:
            return (sort_chunks_by_index(x, sizes_, order_, backend=BE)[0],)
        return sort_chunks_by_index_with_probs(x, sizes_, order_, p, backend=BE)[:2]

    primals, vjp = jax.vjp(f, x, p)
    return primals, vjp(tuple(jnp.ones_like(v) for v in primals))


def run_chunk_sort_by_map(N, H, sizes, order, *, probs=True, seed=0):
    """The chunk sort's row gathers alone, forward and backward, through a map the ``xla``
    backend builds: the sweep of their configs runs no map kernel."""
    from te_jax_perm import make_chunk_sort_map, sort_chunks_by_map

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
    p = jnp.asarray(rng.random(N), jnp.float32) if probs else None
    row_map = make_chunk_sort_map(jnp.asarray(sizes, jnp.int32), jnp.asarray(order, jnp.int32), N, backend="xla")

    def f(x, p):
        out, pp = sort_chunks_by_map(x, row_map, p, backend=BE)
        return (out,) if pp is None else (out, pp)

    primals, vjp = jax.vjp(f, x, p)
    return primals, vjp(tuple(jnp.ones_like(v) for v in primals))


def run_copy(shape, dtype=jnp.bfloat16):
    from benchmarks.copy_baseline import device_copy

    return device_copy(jnp.arange(int(np.prod(shape)), dtype=dtype).reshape(shape), backend=BE)


def run_row_id_map(T, E, k, mode, *, drop=0, single_pass=False, seed=0):
    """The public map build, in one launch or two (counts, then fill)."""
    from te_jax_perm import make_row_id_map

    rm = routing(np.random.default_rng(seed), T, E, k, mode)
    return make_row_id_map(jnp.asarray(rm), max(int(rm.sum()) - drop, 0), block_tokens=4, single_pass=single_pass,
                           backend=BE)


def run_grouped_gemm(M, K, N, sizes, seed=0, dtype=jnp.float32):
    """The expert grouped GEMM forward and backward (input and weight gradients)."""
    from te_jax_perm.ops.grouped_gemm.api import grouped_matmul

    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((M, K)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), K, N)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, backend=BE), lhs, rhs)
    return out, vjp(jnp.ones_like(out))


def run_hopper_row_tile_gemms(M, C, sizes, seed=0, tma_default=True):
    """The forward and input gradient's Hopper declarations, which a CPU run never picks;
    with ``tma_default``, at sizes where their own default is TMA 128x256 tiles (16-bit
    operands; the input gradient's stored in halves)."""
    from te_jax_perm.ops.grouped_gemm import decl as GD

    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((M, C)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), C, C)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    dims, params = {"M": M, "C": C, "D": C, "G": len(sizes)}, {"elem_bytes": 2, "out_dtype": "bfloat16"}
    if tma_default:
        assert GD.hopper_mm_default(dims, params) == GD.HOPPER_TMA_MM
        assert GD.hopper_dgrad_default(dims, params) == GD.HOPPER_TMA_SPLIT
    return (GD.grouped_gemm_hopper(lhs, rhs, gs, backend=BE, **params),
            GD.grouped_gemm_rhs_t_hopper(lhs, rhs, gs, backend=BE, **params))  # C == D: rhs read transposed


def run_moe_ffn(T, H, E, k, F, mode, *, drop=0, align=None, seed=0, dtype=jnp.float32):
    """The fused MoE experts (dispatch and combine inside the GEMMs), forward and backward."""
    import te_jax_perm
    rng = np.random.default_rng(seed)
    rm = routing(rng, T, E, k, mode)
    num_out = max(int(rm.sum()) - drop, 0)
    rm = jnp.asarray(rm)
    x = jnp.asarray(rng.standard_normal((T, H)), dtype)
    p = jnp.asarray(rng.random((T, E)), jnp.float32) * rm
    w_in = jnp.asarray(rng.standard_normal((E, H, 2 * F)) / np.sqrt(H), dtype)
    w_out = jnp.asarray(rng.standard_normal((E, F, H)) / np.sqrt(F), dtype)

    def f(x, p, w_in, w_out):
        return te_jax_perm.moe_ffn(x, rm, p, w_in, w_out, num_out, align_size=align, backend=BE)
    out, vjp = jax.vjp(f, x, p, w_in, w_out)
    return out, vjp(jnp.ones_like(out))


SCENARIOS = {
    "moe_T1_oddH": lambda: run_moe(1, 5, 4, 2, "uniform"),
    "moe_topk_odd": lambda: run_moe(13, 33, 5, 2, "uniform", dtype=jnp.bfloat16),
    "moe_empty_experts": lambda: run_moe(12, 16, 8, 2, "empty"),
    "moe_skewed_k1": lambda: run_moe(17, 24, 4, 1, "hot", probs=False),
    "moe_dropping": lambda: run_moe(16, 20, 4, 2, "hot", drop=7),
    "moe_padding": lambda: run_moe(11, 70, 4, 2, "empty", align=4),
    "moe_drop_and_pad_noprobs": lambda: run_moe(9, 7, 3, 2, "uniform", drop=3, align=8, probs=False),
    "mask_map_inference_dropping": lambda: run_mask_map_inference(15, 24, 6, 2, "hot", drop=4),
    "chunks_empty_and_unmapped": lambda: run_chunk_sort(20, 9, [3, 0, 5, 4, 0, 2], [5, 2, 0, 4, 3, 1]),
    "chunks_T1": lambda: run_chunk_sort(1, 3, [1], [0], probs=False),
    "chunks_full": lambda: run_chunk_sort(24, 96, [8, 8, 8], [2, 0, 1]),
    "copy_odd": lambda: run_copy((7, 13)),
    "row_id_map_two_pass": lambda: run_row_id_map(19, 6, 2, "hot", drop=5),
    "row_id_map_one_pass": lambda: run_row_id_map(19, 6, 2, "uniform", drop=3, single_pass=True),
    # T*E large enough for the dispatch's two-launch map (counts, then the padded, owned fill).
    "moe_two_pass_map": lambda: run_moe(16, 8, 256, 2, "uniform", align=4),
    "grouped_gemm_ragged": lambda: run_grouped_gemm(40, 24, 40, [10, 0, 25]),
    "grouped_gemm_hopper_tma_tiles": lambda: run_hopper_row_tile_gemms(2176, 256, [1000, 0, 1100]),
    # Small enough to run once per config of the Hopper declarations' tuning space.
    "grouped_gemm_hopper_small": lambda: run_hopper_row_tile_gemms(40, 32, [10, 0, 25], tma_default=False),
    "moe_ffn_dropping_padded": lambda: run_moe_ffn(12, 16, 4, 2, 8, "empty", drop=3, align=4),
    # Rows wide enough (H past 2048, a multiple of no block) and tokens enough (4 and more)
    # that every row mover's whole tuning space is valid, for the config sweep, and the same
    # op path on rows of NARROW_H columns, where the tiles those admit run (one scenario per
    # op path, so parallel runs share them out).
    "movers_wide_rows": lambda: (run_moe(4, NARROW_H, 4, 2, "uniform", drop=1), run_moe(4, 2050, 4, 2, "uniform", drop=1)),
    "movers_wide_rows_noprobs": lambda: (run_moe(4, NARROW_H, 4, 2, "uniform", probs=False),
                                         run_moe(4, 2050, 4, 2, "uniform", probs=False)),
    "weighted_unpermute_wide_rows": lambda: (run_weighted_unpermute(4, NARROW_H, 4, 2, "uniform"),
                                             run_weighted_unpermute(4, 2050, 4, 2, "uniform")),
    # 16-bit operands admit larger GEMM tiles than float32's (shared memory): their sweep.
    "grouped_gemm_bf16": lambda: run_grouped_gemm(40, 24, 40, [10, 0, 25], dtype=jnp.bfloat16),
    "moe_ffn_bf16": lambda: run_moe_ffn(12, 16, 4, 2, 8, "empty", drop=3, dtype=jnp.bfloat16),
    "chunks_wide_rows": lambda: tuple(run_chunk_sort_by_map(8, h, [3, 0, 4, 1], [2, 0, 3, 1], probs=probs)
                                      for h in (NARROW_H, 2050) for probs in (True, False)),
}

def sweeping(kernels: tuple[str, ...] | None = None, narrow_h: int | None = None):
    """Which configs a config sweep scenario runs at a launch (``runs(call, config)``): every
    config valid at the launch's size, of ``kernels`` only (all by default; the others keep
    their default config); with ``narrow_h``, at a launch of rows wider than ``narrow_h``
    columns only those rows of ``narrow_h`` columns do not admit and the launch's default,
    the scenario running the rest on such rows. The interpreter runs a program at a time,
    and a narrow tile on a wide row is many programs (or column steps): a wide row is for
    the wide tiles, and for the default that runs there."""
    def runs(call: Call, config) -> bool:
        if kernels is not None and call.decl.name not in kernels:
            return False
        if narrow_h is None or call.dims.get("H", 0) <= narrow_h:
            return True
        return (call.decl.violated({**call.dims, "H": narrow_h}, call.params, config) is not None
                or config.constants == call.decl.default_config(call.dims, call.params).constants)
    return runs


EVERY = sweeping()
# The narrow rows of the wide-row scenarios: a multiple of no block, as 2050 is.
NARROW_H = 130

# Scenarios re-run once per distinct unpruned config of what they sweep; together they
# launch every interpretable kernel in every config some size admits
# (test_the_config_sweep_launches_every_kernel_in_every_config).
CONFIG_SWEEP = {
    **dict.fromkeys(("moe_padding", "chunks_full", "chunks_empty_and_unmapped", "copy_odd", "grouped_gemm_ragged",
                     "moe_drop_and_pad_noprobs", "mask_map_inference_dropping", "row_id_map_two_pass",
                     "row_id_map_one_pass", "moe_two_pass_map", "chunks_T1", "grouped_gemm_hopper_small",
                     "grouped_gemm_bf16"), EVERY),
    "movers_wide_rows": sweeping(narrow_h=NARROW_H),
    "movers_wide_rows_noprobs": sweeping(narrow_h=NARROW_H),
    "weighted_unpermute_wide_rows": sweeping(narrow_h=NARROW_H),
    "chunks_wide_rows": sweeping(narrow_h=NARROW_H),
    # The experts' own GEMM; the grouped GEMMs run their every config in grouped_gemm_ragged
    # (float32) and grouped_gemm_bf16, the row movers and the map in the scenarios above.
    "moe_ffn_dropping_padded": sweeping(("moe_gather_gemm",)),
    "moe_ffn_bf16": sweeping(("moe_gather_gemm",)),
}


def sanitized_launches(name: str) -> set[str]:
    """The kernels scenario ``name`` launches, run once under the sanitizer, which must
    find nothing."""
    with sanitize() as report:
        jax.block_until_ready(SCENARIOS[name]())
    assert not report, f"{name}:\n{report.text()}"
    return {s.kernel for s in report.launches}


def interpretable_kernels() -> set[str]:
    """Every shipped kernel the sanitizer can run (the interpreter runs it)."""
    assert shipped_kernels(), "found no shipped kernel"
    return {name for name, k in shipped_kernels().items() if k.decl.interpretable}


# The config sweep's scenarios run at their default configs in
# test_the_config_sweep_launches_every_kernel_in_every_config.
@pytest.mark.parametrize("name", sorted(set(SCENARIOS) - set(CONFIG_SWEEP)))
def test_shipped_kernels_are_clean(name):
    assert sanitized_launches(name), f"{name}: no kernel launch was observed"


def swept_configs(runs, call: Call) -> list:
    """The distinct unpruned configs a sweep that ``runs`` (see :func:`sweeping`) runs at
    ``call``'s launch; none where it leaves the launch its default config."""
    valid, _ = candidates(call.decl, call.dims, call.params)
    return [c for c in {c.constants: c for c in valid}.values() if runs(call, c)]


class _EveryConfig:
    """Config resolver picking, per launch, the ``k``-th distinct config the sweep runs
    there (``runs``, see :func:`sweeping`); counts the launches lowered (``lowered``)."""

    def __init__(self, runs):
        self.runs = runs
        self.k = 0
        self.rounds = 1
        self.lowered = 0
        self.seen: dict[tuple, set] = {}
        self.want: dict[tuple, set] = {}

    def __call__(self, call):
        self.lowered += 1
        distinct = swept_configs(self.runs, call)
        if not distinct:
            return None
        self.rounds = max(self.rounds, len(distinct))
        cfg = distinct[self.k % len(distinct)]
        key = (call.decl.name, tuple(sorted(call.dims.items())), tuple(sorted(call.params.items())))
        self.seen.setdefault(key, set()).add(cfg.constants)
        self.want[key] = {c.constants for c in distinct}
        return cfg


def relower_kernels() -> None:
    """Makes the next eager kernel calls lower again, consulting the config resolver (it runs
    at lowering time). Eager calls run through one jitted bind per kernel and parameter set;
    dropping those rather than every JAX cache keeps the scenario's other operations
    compiled (recompiling them each round was much of a round's time)."""
    KernelPrimitive.forget_eager_executables()


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIG_SWEEP)
def test_every_unpruned_config_is_clean(name):
    pick = _EveryConfig(CONFIG_SWEEP[name])
    lowered = None
    try:
        with hooks.using_config_resolver(pick):
            jax.clear_caches()  # a lowering cached elsewhere would show as fewer lowerings below
            while pick.k < pick.rounds:
                relower_kernels()
                pick.lowered = 0
                with sanitize() as report:
                    jax.block_until_ready(SCENARIOS[name]())
                assert not report, f"config round {pick.k}:\n{report.text()}"
                # Every round lowers what the first did, after clearing every cache: a launch
                # reusing another round's executable would run that round's config unseen.
                lowered = pick.lowered if lowered is None else lowered
                assert pick.lowered == lowered, f"config round {pick.k}: {pick.lowered} kernel lowerings, not {lowered}"
                pick.k += 1
    finally:
        jax.clear_caches()
    assert pick.seen and pick.seen == pick.want


# -- inputs no kernel may answer with an out-of-bounds access -----------------------------
def run_chunk_sort_overflowing_sizes(sizes, N=10, H=3):
    """Traced ``split_sizes`` whose int32 sum overflows (the sizes are data, not shapes)."""
    from te_jax_perm import sort_chunks_by_index

    x = jnp.arange(N * H, dtype=jnp.float32).reshape(N, H)
    f = jax.jit(lambda x, s, o: sort_chunks_by_index(x, s, o, backend=BE)[0])
    return f(x, jnp.asarray(sizes, jnp.int32), jnp.arange(len(sizes) - 1, -1, -1, dtype=jnp.int32))


def run_combine_short_input(rows=13, T=8, E=4, k=2):
    """``token_combine`` given fewer rows than the row-id map addresses (map built for T*k)."""
    from te_jax_perm import token_combine, token_dispatch

    rng = np.random.default_rng(0)
    rm = jnp.asarray(routing(rng, T, E, k))
    x = jnp.asarray(rng.standard_normal((T, 16)), jnp.float32)
    out, _, rid, _, _ = token_dispatch(x, rm, T * k, backend=BE)
    p = jnp.asarray(rng.random((T, E)), jnp.float32) * rm
    return token_combine(out[:rows], rid, backend=BE), token_combine(out[:rows], rid, merging_probs=p, backend=BE)


def run_dispatch_map_foreign_counts(counts):
    """The dispatch's two-pass map given traced ``counts`` that are not its routing map's
    block counts (negative ones put rows before the buffer's first)."""
    from te_jax_perm.ops.row_id_map import decl as D

    rm = jnp.ones((4, 2), bool)
    f = jax.jit(lambda rm, c: D.dispatch_map_fill(rm, c, backend=BE, block_t=1, drop_at=8, align=1, num_out_rows=8))
    return f(rm, jnp.asarray(counts, jnp.int32))


HOSTILE = {
    "dispatch_map_counts_negative": lambda: run_dispatch_map_foreign_counts([[-5, -3], [1, 1], [-9, 1], [1, 1]]),
    "dispatch_map_counts_huge": lambda: run_dispatch_map_foreign_counts([[2**30, 2**30], [2**30, 1], [1, 1], [0, 0]]),
    "chunk_sort_sizes_2^30+2^30": lambda: run_chunk_sort_overflowing_sizes([2**30, 2**30]),
    "chunk_sort_sizes_2^31-1+5": lambda: run_chunk_sort_overflowing_sizes([2**31 - 1, 5]),
    "combine_short_input": run_combine_short_input,
    # Group sizes are data: negative, summing past M, or near 2**31 must stay inside the rows.
    "grouped_gemm_sizes_negative_and_past_M": lambda: run_grouped_gemm(17, 16, 24, [-3, 7, 2, 100]),
    "grouped_gemm_sizes_2^31-1": lambda: run_grouped_gemm(9, 8, 8, [2**31 - 1, 2**31 - 1]),
    "grouped_gemm_hopper_tma_tiles_hostile_sizes": lambda: run_hopper_row_tile_gemms(2176, 256, [-3, 1000, 2**31 - 1]),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_inputs_access_nothing_out_of_bounds(name):
    """Sizes that overflow int32 and an input shorter than its map are user errors the ops
    must answer with a defined result or a trace-time error naming the argument, never with
    an access outside a buffer (unsanitized, the overflow case is a host SIGSEGV here and an
    out-of-bounds write on the GPU)."""
    with sanitize() as report:
        try:
            jax.block_until_ready(HOSTILE[name]())
        except ValueError as e:   # a clear trace-time refusal is the other acceptable answer
            assert "inp" in str(e) or "split_sizes" in str(e), e
    assert not report, report.text()


class _Coverage:
    """Config resolver that keeps each launch's default and records, per kernel, the
    distinct configs the config sweep runs at its size (``swept``; the scenario's ``runs``,
    see :func:`sweeping`, says which: the default where it sweeps none), the defaults it
    would leave unswept (``unswept_defaults``), and the configs of its tuning space valid
    at some size (``valid_somewhere``: every dim 8192, the launch's params), leaving out
    what no size admits (e.g. tiles past shared memory at this dtype)."""

    BIG = 8192

    def __init__(self):
        self.runs = EVERY
        self.swept: dict[str, set] = {}
        self.unswept_defaults: set[tuple] = set()
        self.valid_somewhere: dict[str, set] = {}

    def __call__(self, call):
        decl = call.decl
        default = decl.default_config(call.dims, call.params)
        swept = swept_configs(self.runs, call)
        if swept and default.constants not in {c.constants for c in swept}:
            self.unswept_defaults.add((decl.name, default.constants))
        self.swept.setdefault(decl.name, set()).update(c.constants for c in swept or [default])
        big = dict.fromkeys(call.dims, self.BIG)
        self.valid_somewhere.setdefault(decl.name, set()).update(
            c.constants for c in decl.configs if not decl.violated(big, call.params, c))
        return None


def test_the_config_sweep_launches_every_kernel_in_every_config():
    """The config sweep's scenarios launch every interpretable kernel, each at a size where
    every config of its tuning space that any size admits is valid, and wherever a scenario
    sweeps a kernel its sweep includes the default: none ships that never ran under the
    sanitizer, in any config. Which kernels launch, at which sizes, is decided when the
    scenario lowers, so each is lowered under ``jax.jit`` and not run (the sweeps run them)."""
    cover, launched = _Coverage(), set()
    with hooks.using_config_resolver(cover):
        jax.clear_caches()  # the resolver runs at lowering time
        for name, runs in CONFIG_SWEEP.items():
            cover.runs = runs
            # On the CPU device, also on a GPU machine: the interpreter lowers for the CPU only.
            here: set[str] = set()
            with hooks.observe_calls(lambda call: here.add(call.decl.name)), \
                    jax.default_device(jax.devices("cpu")[0]):
                jax.jit(SCENARIOS[name]).lower()
            assert here, f"{name}: no kernel launch was observed"
            launched |= here
    jax.clear_caches()
    missing = interpretable_kernels() - launched
    assert not missing, f"kernels no CONFIG_SWEEP scenario launches (add one that does): {sorted(missing)}"
    assert not cover.unswept_defaults, f"defaults a sweep leaves out: {sorted(cover.unswept_defaults)}"
    unswept = {k: sorted(v - cover.swept.get(k, set())) for k, v in cover.valid_somewhere.items()
               if v - cover.swept.get(k, set())}
    assert not unswept, ("configs no CONFIG_SWEEP scenario runs (add one at a size where they are valid): "
                         + "; ".join(f"{k}: {len(v)}, e.g. {v[0]}" for k, v in sorted(unswept.items())))


def test_every_kernel_the_sanitizer_cannot_run_is_in_the_hostile_memcheck():
    """A kernel the interpreter cannot run (a Gluon kernel) escapes the sanitizer sweep, so
    a GPU test that launches it by name must be among the tests the GPU suite runs under
    compute-sanitizer's memcheck."""
    import pathlib
    import re

    from tests.gpu.hostile import HOSTILE_TESTS
    root = pathlib.Path(__file__).resolve().parent.parent
    sources = []
    for target in HOSTILE_TESTS:
        path, _, test = target.partition("::")
        text = (root / path).read_text()
        if test:  # that test's source only: from its def to the next top-level statement
            text = re.search(rf"^def {re.escape(test)}\(.*?(?=^\S)", text + "\n#", re.S | re.M).group(0)
        sources.append(text)
    opaque = [name for name, k in shipped_kernels().items() if not k.decl.interpretable]
    if not opaque:
        pytest.skip("every shipped kernel runs under the sanitizer")
    for name in opaque:
        assert any(re.search(rf"\b{name}\(", src) for src in sources), (
            f"{name} cannot run under the sanitizer and no test in tests/gpu/hostile.py's HOSTILE_TESTS launches it")
