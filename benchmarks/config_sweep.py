"""Every candidate config of the row-moving and row-id-map kernels, timed on the GPU.

    python3 -m benchmarks.config_sweep --out DIR [--part movers,rowmap] [--shapes ...] [--budget-s 400]
    python3 -m benchmarks.config_sweep --table [SWEEP.json ...]   # the movers' default table

``movers``: at each benchmark shape, every op direction's main kernel (dispatch's
``permute_probs``, combine's ``unpermute_weighted``, and their backwards) on the operands
the op really hands it, launched directly through the backend's call under every tile
shape and warp count its declaration allows, then the fastest few at every stage count;
each config's outputs are checked against the default's (bitwise for kernels that only move
data, within the declared tolerance for those that sum); one that disagrees never enters the table.
Then a runoff: the configs within a few percent of the fastest, and the default, timed again
together over several profiles in turns; their runoff times are the ones recorded.
``--kernels`` also takes the chunk sort's row mover (``sort_chunks_probs``, forward and
backward: a rule, and table entries where a sweep found better).
``rowmap``: ``make_row_id_map`` over a grid of token and expert counts, one launch or two,
every block size and warp count. Kernel times from one CUPTI profile per group
(``benchmarks/kernel_timer.py``). Writes ``DIR/sweep_<part>.json``; ``--table`` turns mover
sweeps into the shipped tables of default configs, one per device the sweeps ran on
(``te_jax_perm/ops/tuned_defaults_sm90.json``, read by :mod:`te_jax_perm.ops.tuned_defaults`),
keyed by each kernel's row width and row count (its declaration's first key dim); with no
files, from the sweeps listed in ``benchmarks/results/mover_table_sweeps.txt``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Callable

import numpy as np

from benchmarks import kernel_timer
from benchmarks.results_io import write_json
from benchmarks.shapes import GPU_SHAPES, OFF_LIST_SHAPES, by_name

# (case, kernel declaration name) pairs of the row movers.
MOVERS = (("token_combine.fwd", "unpermute_weighted"), ("token_dispatch.fwd", "permute_probs"),
          ("token_dispatch.bwd", "permute_bwd_probs"), ("token_combine.bwd", "unpermute_bwd_weighted"))
# Swept only when named in --kernels: the chunk sort's row mover, forward and backward.
AUX = (("sort_chunks_by_index.fwd", "sort_chunks_probs"), ("sort_chunks_by_index.bwd", "sort_chunks_probs"))
# Phase one times every tile shape and warp count at one stage count; phase two gives the
# TOP fastest every stage count.
FIRST_STAGES = 3
TOP = 6
# Phase three, the runoff: the configs within RUNOFF_PCT of the fastest (at most
# RUNOFF_MAX of them) and the default are timed again together, RUNOFF_ROUNDS profiles with
# their order reversed every other one, and those times decide. One profile of a few calls
# puts configs 1% apart in either order from run to run (2 against 4 warps for the combine
# backward at DeepSeek-V3 T16384 on an H200: the table held 4 warps, which four later runs
# in turns each measured 0.7-0.8% slower).
RUNOFF_PCT = 3.0
RUNOFF_MAX = 6
RUNOFF_ROUNDS = 5


class _Found(Exception):
    def __init__(self, operands, params):
        self.operands, self.params = operands, params


def capture_operands(fn: Callable, args: tuple, name: str) -> tuple[list, dict]:
    """The concrete operands and static params of kernel ``name``'s first launch inside
    ``fn(*args)``: the program's jaxpr is evaluated equation by equation (descending into
    nested jaxprs) until that kernel's primitive is reached."""
    import jax
    from jax.extend import core as jcore
    targets = {f"te_jax_perm_{name}", f"te_jax_perm_{name}_local"}

    def contains(jaxpr) -> bool:
        return any(e.primitive.name in targets or any(contains(j) for j in _subjaxprs(e, len(e.invars)))
                   for e in jaxpr.eqns)

    def run(jaxpr, consts, vals):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, vals))
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if eqn.primitive.name in targets:
                raise _Found(ins, {k: v for k, v in eqn.params.items() if k not in ("backend", "config")})
            subs = [j for j in _subjaxprs(eqn, len(ins)) if contains(j)]
            if subs:
                outs = run(subs[0], [], ins)
            else:
                bind = eqn.primitive.get_bind_params(eqn.params)  # older jax: (subfuns, params)
                subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
                outs = eqn.primitive.bind(*subfuns, *ins, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    closed = jax.make_jaxpr(fn)(*args)
    try:
        run(closed.jaxpr, closed.consts, jax.tree.leaves(args))
    except _Found as f:
        return f.operands, f.params
    raise LookupError(f"no launch of {name} in the program")


def _subjaxprs(eqn, n_in: int) -> list:
    """Nested jaxprs of ``eqn`` that take its operands (with their consts folded in)."""
    from jax.extend import core as jcore
    out = []
    for v in eqn.params.values():
        if isinstance(v, jcore.ClosedJaxpr) and len(v.jaxpr.invars) == n_in and not v.consts:
            out.append(v.jaxpr)
        elif isinstance(v, jcore.Jaxpr) and len(v.invars) == n_in and not v.constvars:
            out.append(v)
    return out


def mover_call(problem, case_name: str, kernel: str, backend: str = "triton") -> tuple:
    """``(call, operands)``: the operands the op of case ``case_name`` hands ``kernel`` at
    ``problem`` (a ``cases.Problem``) on ``backend``, and the backend call of ``kernel``'s
    declaration (a permutation or chunk-sort kernel) bound to them."""
    from benchmarks import cases
    from te_jax_perm.core.launch import bind_call
    from te_jax_perm.ops.chunk_sort import decl as chunk_sort
    from te_jax_perm.ops.permute import decl as movers
    built = next(c for c in cases.CASES if c.name == case_name).build(problem, backend)
    operands, params = capture_operands(built.fn, built.args, kernel)
    prim = getattr(movers, kernel, None) or getattr(chunk_sort, kernel)
    return bind_call(prim.decl, operands, params, backend), operands


def sweep_candidates(decl, dims, params, stages=None, quick: bool = False) -> list:
    """The declaration's valid configs at ``stages``: of each tile shape and warp count, the
    configs at those stage counts, or where it declares none of them, the one at the nearest
    stage count (a family declared at fewer stage counts is still timed); ``quick``: only one
    token per program, its whole row or half of it per tile (the shapes every mover default
    has taken), at each warp count."""
    valid = [c for c in decl.configs if not decl.violated(dims, params, c)]
    if quick:
        from te_jax_perm.ops.permute.decl import whole_row
        whole = whole_row(dims)
        valid = [c for c in valid if c.kw.get("ROWS") == 1 and c.kw.get("BLOCK_H") in (whole, whole // 2)]
    if stages is None:
        return valid or [decl.default_config(dims, params)]
    families: dict = {}
    for c in valid:
        families.setdefault((tuple(sorted(c.kw.items())), c.num_warps), []).append(c)
    out = []
    for family in families.values():
        out += ([c for c in family if c.num_stages in stages]
                or [min(family, key=lambda c: min(abs(c.num_stages - s) for s in stages))])
    return out or [decl.default_config(dims, params)]


def _precompile(launches: list) -> dict:
    """Compiles every launch's kernel in the autotuner's worker pool (filling Triton's cache)."""
    from te_jax_perm.autotune.pool import make_job
    from te_jax_perm.autotune.pool import get_pool
    from te_jax_perm.core.triton_backend import compute_capability
    cc = compute_capability()
    t0 = time.monotonic()
    results = get_pool().compile_many([make_job(l, ("cuda", cc, 32)) for l in launches])
    return {"compiled": sum(r.ok for r in results), "failed": sum(not r.ok for r in results),
            "compile_s": time.monotonic() - t0}


def runoff_entrants(group: list[dict], default: str) -> list[dict]:
    """The rows of ``group`` (one per config, as :func:`_time_configs` returns them) that run
    in the runoff: timed configs whose outputs agree, within :data:`RUNOFF_PCT` of the
    fastest (the fastest :data:`RUNOFF_MAX`), and the ``default`` config's row however slow;
    none where fewer than two would run (nothing to decide)."""
    ok = sorted((r for r in group if r.get("us") is not None and r.get("agrees")), key=lambda r: r["us"])
    if not ok:
        return []
    close = [r for r in ok if r["us"] <= ok[0]["us"] * (1 + RUNOFF_PCT / 100)][:RUNOFF_MAX]
    entrants = close + [r for r in ok if r["config_str"] == default and r not in close]
    return entrants if len(entrants) >= 2 else []


def within_budget(configs: list, deadline: float | None, clock: Callable[[], float] = time.monotonic):
    """``(config, run)`` for each of ``configs`` in order: the first always runs, the others
    only while ``clock()`` is before ``deadline`` (None: no deadline). A sweep's budget is
    then kept inside a group too, where one group of every config at a large shape can take
    longer than the whole budget; the configs left out are recorded as such."""
    for i, c in enumerate(configs):
        yield c, i == 0 or deadline is None or clock() < deadline


def _time_configs(call, configs, operands, want, calls: int, rounds: int = 1,
                  deadline: float | None = None) -> list[dict]:
    """Each config's kernel time (CUPTI; with ``rounds`` > 1 over that many profiles, their
    order reversed every other one) and whether its outputs agree with ``want``, the
    default config's, as the autotuner judges a candidate (``trials.mismatch``). Past
    ``deadline`` (``time.monotonic``) configs after the first are not compiled or timed."""
    import jax
    from te_jax_perm.autotune.trials import mismatch
    from te_jax_perm.core.launch import configure
    from te_jax_perm.core.triton_backend import triton_call
    launches = {str(c): configure(call, c) for c in configs}
    _precompile(list(launches.values()))
    items, rows = [], []
    for cfg, run in within_budget(configs, deadline):
        if not run:
            rows.append({"config": cfg.to_json(), "config_str": str(cfg), "skipped": "budget spent"})
            continue
        launch = launches[str(cfg)]
        try:
            exe = jax.jit(lambda ops, launch=launch: triton_call(launch, ops)).lower(operands).compile()
            got = exe(operands)
            items.append((cfg, (lambda exe=exe: exe(operands))))
            why = mismatch(call.decl, got, want)
            rows.append({"config": cfg.to_json(), "config_str": str(cfg), "agrees": why is None}
                        | ({"disagrees": why} if why else {}))
        except Exception as e:  # noqa: BLE001 - a failing config is recorded, the rest go on
            rows.append({"config": cfg.to_json(), "config_str": str(cfg), "error": f"{type(e).__name__}: {e}"})
    kfn = call.decl.kernel.fn.__name__
    times = {t.label: t.per_call_us(lambda n: n.startswith(kfn))
             for t in kernel_timer.measure(items, calls=calls, warmup=1, rounds=rounds)}
    for r in rows:
        r["us"] = times.get(_config(r["config"]))
    return rows


def _config(j):
    from te_jax_perm.core import Config
    return Config.from_json(j)


def sweep_movers(shapes, budget_s: float, calls: int, log, kernels: str = "",
                 save: Callable[[list[dict]], None] = lambda rows: None, quick: bool = False) -> list[dict]:
    """Every group (shape, kernel) in turn; ``save(rows)`` after each, so a run cut off
    keeps what it measured. A group starts only if the longest group so far still fits,
    and within a group configs after the default are timed only while the budget lasts.
    ``quick``: the :func:`sweep_candidates` of ``quick`` at one stage count, no second phase
    (about a tenth of the configs: a device's whole table in a few minutes); the runoff
    runs either way (a few configs timed again: a close call is decided by it, not by noise)."""
    import jax
    import numpy as np
    from benchmarks import cases
    from te_jax_perm.core.launch import configure
    from te_jax_perm.core.triton_backend import triton_call
    rows, deadline = [], time.monotonic() + budget_s
    # Forward movers at every shape first, so a short budget still covers them.
    order = [(shape, pair) for pairs in (MOVERS[:2], MOVERS[2:] + AUX) for shape in shapes for pair in pairs
             if pair[1] in kernels.split(",") or (not kernels and pair in MOVERS)]
    p, longest = None, 0.0
    for shape, (case_name, kname) in order:
        started = time.monotonic()
        if started + longest > deadline:
            log(f"budget spent: {shape.name} {case_name} not swept")
            continue
        if p is None or p.shape != shape:
            p = None  # free the previous shape's buffers first
            p = cases.Problem.make(shape)
        try:
            call, operands = mover_call(p, case_name, kname)
            decl = call.decl
            default = decl.default_config(call.dims, call.params)
            want = [np.asarray(o) for o in jax.jit(lambda ops: triton_call(configure(call, default), ops))(operands)]
            cands = sweep_candidates(decl, call.dims, call.params, {1 if quick else FIRST_STAGES}, quick)
            log(f"{shape.name} {kname}: {len(cands)} configs")
            # The default first: it runs whatever the budget says, and the table compares with it.
            first = _time_configs(call, [default] + [c for c in cands if str(c) != str(default)],
                                  operands, want, calls, deadline=deadline)
            timed = sorted((r for r in first if r.get("us") is not None), key=lambda r: r["us"])
            tried = {r["config_str"] for r in first}
            second = [] if quick else [c for r in timed[:TOP] for c in _restaged(decl, _config(r["config"]))
                                       if str(c) not in tried]
            group = first + (_time_configs(call, second, operands, want, calls, deadline=deadline)
                             if second and time.monotonic() < deadline else [])
            entrants = runoff_entrants(group, str(default))
            if entrants:
                rerun = {r["config_str"]: r for r in _time_configs(
                    call, [_config(r["config"]) for r in entrants], operands, want, calls, RUNOFF_ROUNDS)}
                for r in entrants:
                    again = rerun[r["config_str"]]
                    if again.get("us") is not None and again.get("agrees"):
                        # The runoff's time decides: the table reads "us".
                        r.update(swept_us=r["us"], us=again["us"], runoff=True)
            for r in group:
                r.update({"shape": shape.name, "T": shape.T, "H": shape.H, "E": shape.E, "k": shape.k,
                          "rows": call.dims[decl.key_dims[0]],  # the kernel's row count: the table's key
                          "case": case_name, "kernel": kname, "is_default": r["config_str"] == str(default)})
            rows += group
            ok = [r for r in group if r.get("us") is not None and r.get("agrees")]
            best = min(ok, key=lambda r: r["us"])
            dflt = next(r for r in group if r["is_default"])
            wrong = [f'{r["config_str"]}: {r["disagrees"]}' for r in group if r.get("agrees") is False]
            log(f"{shape.name:40s} {kname:24s} {len(group):3d} configs default {dflt['us']:8.1f} µs "
                f"{dflt['config_str']} | best {best['us']:8.1f} µs {best['config_str']} "
                f"({dflt['us'] / best['us']:.3f}x)" + (f" | WRONG OUTPUT: {wrong}" if wrong else "")
                + (f" | {left} not timed (budget spent)" if (left := sum("skipped" in r for r in group)) else ""))
        except Exception:  # one failing group must not end the sweep
            log(f"{shape.name} {case_name}: FAILED\n{traceback.format_exc()}")
        save(rows)
        longest = max(longest, time.monotonic() - started)
    return rows


TABLE_SWEEPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "mover_table_sweeps.txt")


def table_sweeps(listing: str = TABLE_SWEEPS) -> list[str]:
    """The sweep files a listing names (one per line beside it, ``#`` comments), in order."""
    with open(listing) as f:
        names = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    return [os.path.join(os.path.dirname(listing), n) for n in names]


def default_tables(sweeps: list[str], tables: dict | None = None) -> dict:
    """``tables`` (device kind -> table, as shipped) with the table of every device the
    ``sweeps`` were measured on rebuilt from them (:func:`default_table`); other devices'
    tables are kept, in their order."""
    by_device: dict[str, list[str]] = {}
    for path in sweeps:
        with open(path) as f:
            by_device.setdefault(json.load(f)["meta"]["device"], []).append(path)
    out = dict(tables or {})
    for device, paths in by_device.items():
        out[device] = default_table(paths)
    return out


def default_table(sweeps: list[str]) -> dict:
    """The best config of each mover kernel at each row width H and row count (the token
    count T for the permutation's movers) measured in ``sweeps`` (sweep JSON files of one
    device), keyed ``kernel -> H -> rows -> config``: the table the defaults read. Shapes that share a key (e.g. two models with
    H=4096 at T=8192) share its entry: the config whose worst slowdown against each shape's
    own best is least (then the least summed slowdown), among the configs measured at all
    of them. A (kernel, H, T) key measured in a later file replaces the earlier files' (a
    re-sweep after a kernel changed supersedes the old timings)."""
    best: dict = {}
    for path in sweeps:
        times: dict = {}   # key -> shape -> config string -> (config, µs)
        with open(path) as f:
            for r in json.load(f)["rows"]:
                # A config whose outputs disagree with the default's is never a default
                # (sweeps older than the "agrees" field compared bitwise only: kept).
                if r.get("us") is None or "error" in r or r.get("agrees") is False:
                    continue
                # The kernel's own row count (sweeps from before it was recorded swept only
                # the permutation's movers, whose row count is the token count T).
                key = (r["kernel"], str(r["H"]), str(r.get("rows", r["T"])))
                # A kernel run by two directions of one op (the chunk sort's forward and
                # backward) is timed in each: both are shapes the entry must serve.
                by_cfg = times.setdefault(key, {}).setdefault((r.get("shape", ""), r.get("case", "")), {})
                c = json.dumps(r["config"], sort_keys=True)
                if c not in by_cfg or r["us"] < by_cfg[c][1]:
                    by_cfg[c] = (r["config"], r["us"])
        for (kernel, h, t), shapes in times.items():
            common = set.intersection(*(set(by_cfg) for by_cfg in shapes.values()))
            if not common:  # no config measured at every shape: the largest shape's best
                by_cfg = max(shapes.values(), key=lambda b: min(us for _, us in b.values()))
                common = {min(by_cfg, key=lambda c: by_cfg[c][1])}
            fastest = {s: min(us for _, us in by_cfg.values()) for s, by_cfg in shapes.items()}
            slowdowns = {c: [shapes[s][c][1] / fastest[s] for s in shapes if c in shapes[s]] for c in common}
            pick = min(sorted(common), key=lambda c: (max(slowdowns[c]), sum(slowdowns[c])))
            best.setdefault(kernel, {}).setdefault(h, {})[t] = next(by_cfg[pick][0] for by_cfg in shapes.values()
                                                                     if pick in by_cfg)
    return {k: {h: {t: c for t, c in sorted(by_t.items(), key=lambda kv: int(kv[0]))}
                for h, by_t in sorted(v.items(), key=lambda kv: int(kv[0]))}
            for k, v in sorted(best.items())}


def _restaged(decl, cfg) -> list:
    """``decl``'s configs of ``cfg``'s tile shape and warp count at its other stage counts."""
    return [c for c in decl.configs
            if c.kw == cfg.kw and c.num_warps == cfg.num_warps and c.num_stages != cfg.num_stages]


def _forced_jit(fn: Callable, args: tuple, name: str, config) -> Callable:
    """``fn`` compiled afresh with ``config`` for kernel ``name`` (defaults for the others).

    JAX caches lowerings per function, and the config is chosen while lowering: caches are
    cleared first, and the resolver must have been consulted for ``name``, or the group's
    timings would all be of one binary."""
    import jax
    from te_jax_perm.core import hooks
    used = []

    def resolve(call):
        if call.decl.name == name:
            used.append(call)
            return config
        return None

    jax.clear_caches()
    with hooks.using_config_resolver(resolve):
        # Compiled ahead: a later cache clear would otherwise re-lower it, with the defaults.
        f = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
        jax.block_until_ready(f(*args))
    if not used:
        raise RuntimeError(f"lowering never chose a config for {name}: the sweep would time one binary")
    return f


ROWMAP_T = (16, 64, 256, 1024, 4096, 16384)
ROWMAP_E = (8, 32, 128, 256)
ROWMAP_BT = (1, 2, 4, 8, 16, 32, 64, 128)
ROWMAP_WARPS = (1, 4, 8)


def sweep_rowmap(budget_s: float, calls: int, log) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from te_jax_perm.workloads import topk_routing
    from te_jax_perm.core import Config
    from te_jax_perm.core.launch import bind_call, configure
    from te_jax_perm.ops.row_id_map.api import make_row_id_map
    from te_jax_perm.ops.row_id_map.decl import row_id_map_block_counts, row_id_map_fill, row_id_map_fused
    from te_jax_perm.ops.row_id_map.reference import num_blocks
    rows, t0 = [], time.monotonic()
    rng = np.random.default_rng(0)
    # Compile everything first: E and the block size are compiled in, T is not.
    variants = []
    for E in ROWMAP_E:
        for T in ROWMAP_T:
            for bt in ROWMAP_BT:
                nb = num_blocks(T, bt)
                if bt > T or nb > 4096:
                    continue
                for single in (True, False):
                    if not single and nb == 1:
                        continue
                    for w in ROWMAP_WARPS:
                        variants.append((T, E, bt, single, w))
    per_compile = {}
    for (T, E, bt, single, w) in variants:
        rm = jax.ShapeDtypeStruct((T, E), jnp.bool_)
        params = {"block_t": bt, "drop_at": 2**31 - 1}
        cfg = Config.make(num_warps=w)
        if single:
            ls = [configure(bind_call(row_id_map_fused.decl, [rm], params, "triton"), cfg)]
        else:
            counts = jax.ShapeDtypeStruct((num_blocks(T, bt), E), jnp.int32)
            ls = [configure(bind_call(row_id_map_block_counts.decl, [rm], {"block_t": bt}, "triton"), cfg),
                  configure(bind_call(row_id_map_fill.decl, [rm, counts], params, "triton"), cfg)]
        for l in ls:
            per_compile[(l.decl.name, E, bt, w)] = l  # T is runtime: one binary serves every T
    info = _precompile(list(per_compile.values()))
    log(f"rowmap: {len(variants)} variants, {len(per_compile)} binaries ({info})")
    for T in ROWMAP_T:
        for E in ROWMAP_E:
            if time.monotonic() - t0 > budget_s:
                log(f"budget spent: T={T} E={E} not swept")
                continue
            try:
                rm = jnp.asarray(topk_routing(rng, T, E, min(8, E))[0])
                items = []
                for (t, e, bt, single, w) in variants:
                    if (t, e) != (T, E):
                        continue
                    cfg = Config.make(num_warps=w)
                    f = _forced_jit(lambda m, bt=bt, single=single: make_row_id_map(
                        m, None, block_tokens=bt, single_pass=single, backend="triton"), (rm,),
                        "row_id_map_fused" if single else "row_id_map_fill", cfg)
                    items.append(((bt, single, w), (lambda f=f: f(rm))))
                times = kernel_timer.measure(items, calls=calls, warmup=1)
                for t in times:
                    bt, single, w = t.label
                    rows.append({"T": T, "E": E, "block_t": bt, "single_pass": single, "num_warps": w,
                                 "us": t.per_call_us(), "kernels": t.by_name()})
                mine = [x for x in rows if x["T"] == T and x["E"] == E]
                best = min(mine, key=lambda x: x["us"])
                log(f"rowmap T={T:6d} E={E:4d}: best {best['us']:7.1f} µs (block_t={best['block_t']}, "
                    f"single={best['single_pass']}, warps={best['num_warps']}) of {len(mine)}")
            except Exception:
                log(f"rowmap T={T} E={E}: FAILED\n{traceback.format_exc()}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for the sweep JSON (required unless --table)")
    ap.add_argument("--part", default="movers,rowmap", help="comma-separated sweeps to run: movers, rowmap")
    ap.add_argument("--shapes", default="", help="comma-separated substrings of the movers' shape names "
                    "(default: all)")
    ap.add_argument("--table", nargs="*", default=None, metavar="SWEEP_JSON",
                    help="rebuild the movers' default table of each device these sweep files (default: "
                         "those listed in benchmarks/results/mover_table_sweeps.txt) were measured on, in "
                         "te_jax_perm/ops/tuned_defaults_sm90.json (other devices' tables kept), and exit")
    ap.add_argument("--kernels", default="", help="comma-separated kernel names: the four movers (the default) "
                    "and sort_chunks_probs")
    ap.add_argument("--tokens", default="", help="comma-separated token counts replacing each shape's T "
                    "(small-T sweeps, e.g. 16,64,256)")
    ap.add_argument("--quick", action="store_true",
                    help="movers: whole- and half-row tiles of one token at each warp count, one stage count")
    ap.add_argument("--budget-s", type=float, default=400.0, help="wall-clock budget in seconds for each sweep (a group's configs after its "
                    "default are not timed once it is spent)")
    ap.add_argument("--calls", type=int, default=5, help="timed calls per config (median taken)")
    args = ap.parse_args(argv)
    unknown = [p for p in args.part.split(",") if p not in ("movers", "rowmap")]
    if unknown:
        ap.error(f"--part: {unknown} not among movers, rowmap")
    # A name no pair carries would sweep nothing and write an empty file after the GPU's start-up.
    known = list(dict.fromkeys(kname for _, kname in MOVERS + AUX))
    if unknown := [k for k in args.kernels.split(",") if k and k not in known]:
        ap.error(f"--kernels: {unknown} not among {', '.join(known)}")
    if args.table is not None:
        from te_jax_perm.ops import tuned_defaults
        tables = default_tables(args.table or table_sweeps(), tuned_defaults.shipped_tables())
        write_json(tuned_defaults.DEFAULTS_TABLE, tables)
        return 0
    if not args.out:
        ap.error("--out is required to sweep")
    if bad := [t for t in args.tokens.split(",") if t and not (t.isdigit() and int(t) >= 1)]:
        ap.error(f"--tokens: {bad} are not positive integers")
    if args.calls < 1:
        ap.error(f"--calls={args.calls} must be at least 1")
    parts = args.part.split(",")
    # The movers' shapes are picked before the GPU starts: a --shapes that matches nothing ends here.
    shapes = by_name(args.shapes, GPU_SHAPES + OFF_LIST_SHAPES) if "movers" in parts else ()
    if args.tokens:
        import dataclasses
        shapes = tuple(dataclasses.replace(s, T=int(t)) for s in shapes for t in args.tokens.split(",") if t)
    import jax
    os.makedirs(args.out, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    def saver(name: str) -> Callable[[list[dict]], None]:
        def save(rows: list[dict]) -> None:
            write_json(os.path.join(args.out, name), {"meta": meta, "rows": rows})
        return save

    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if "movers" in parts:
        sweep_movers(shapes, args.budget_s, args.calls, log, args.kernels, saver("sweep_movers.json"), args.quick)
    if "rowmap" in parts:
        saver("sweep_rowmap.json")(sweep_rowmap(args.budget_s, args.calls, log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
