"""Autotuner: pruning, key contents, identical trials, validation, cache, resolver."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import _autotune_kernels as K
from te_jax_perm import autotune
from te_jax_perm.autotune import cache
from te_jax_perm.autotune.trials import initial_prealloc
from te_jax_perm.autotune.trials import HostRunner, run_trials
from te_jax_perm.core import Config, declare
from te_jax_perm.core.aliasing import alias_plan

SHAPE = [((64, 16), np.float32)]


pytestmark = pytest.mark.usefixtures("tmp_cache")


def test_pruning_drops_invalid_configs_before_trials():
    cfgs = K.SAFE_CONFIGS + (K.RACY_CONFIG, Config.make(BS=128, BT=4))
    decl = K.accumulate_decl(configs=cfgs, constraints=(K.tiles_own_rows, K.not_wider_than_rows))
    valid, pruned = autotune.candidates(decl, {"T": 64, "H": 16}, {})
    assert {c for c, _ in pruned} == {K.RACY_CONFIG, Config.make(BS=128, BT=4)}
    assert "not a multiple" in dict(pruned)[K.RACY_CONFIG]
    assert set(valid) == set(K.SAFE_CONFIGS) | {Config.make(BS=8, BT=8)}  # + the default
    res = autotune.tune(decl, SHAPE, backend="interpret")
    timed = {Config.from_json(c) for c, _ in res.entry["ranking"]}
    assert K.RACY_CONFIG not in timed and len(res.entry["pruned"]) == 2
    assert autotune.stats["trials"] == len(valid)


def _key(decl, dims=None, params=None, dtype=np.float32, backend="interpret"):
    return cache.make_key(decl, dims or {"T": 64, "H": 16}, params or {}, [dtype], backend)


def test_key_holds_exactly_the_declared_values(monkeypatch):
    decl = K.accumulate_decl()
    base = _key(decl)
    assert set(base) == {"kernel", "backend", "dims", "params", "dtypes", "device", "versions", "source"}
    # Same bucket (next power of two) -> same key; a new bucket of each key dim -> new key.
    assert _key(decl, {"T": 40, "H": 16}) == base
    assert _key(decl, {"T": 64, "H": 9}) == base
    assert _key(decl, {"T": 65, "H": 16}) != base
    assert _key(decl, {"T": 64, "H": 17}) != base
    assert _key(decl, dtype=np.float16) != base
    assert _key(decl, backend="triton") != base
    # Params: only key_params count.
    pdecl = K.accumulate_decl(name="p", params=("mode", "tag"), key_params=("mode",))
    pk = _key(pdecl, params={"mode": 1, "tag": "a"})
    assert _key(pdecl, params={"mode": 1, "tag": "b"}) == pk
    assert _key(pdecl, params={"mode": 2, "tag": "a"}) != pk
    # Environment: versions and device.
    monkeypatch.setattr(cache, "versions", lambda: {"jax": "0", "triton": "0"})
    assert _key(decl) != base
    monkeypatch.undo()
    monkeypatch.setattr(cache, "device_kind", lambda b: "H100")
    assert _key(decl) != base


def test_a_declaration_without_key_dims_keys_every_dim():
    """Declared as the docs first teach it (no ``key_dims``), a result tuned at one shape
    is never reused at another."""
    from tests.example_kernels import gather_rows
    decl = gather_rows.decl
    assert decl.key_dims == ("N", "H", "R")
    at = lambda n, h, r: cache.make_key(decl, {"N": n, "H": h, "R": r}, {}, [np.float32, np.int32], "interpret")
    assert at(16, 64, 8) == at(16, 64, 8)
    assert len({str(at(16, 64, 8)), str(at(4, 1000, 8)), str(at(16, 64, 9)), str(at(17, 64, 8))}) == 4
    assert K.accumulate_decl().key_dims == ("T", "H")      # an explicit key is kept


def test_shipped_kernels_bucket_their_row_count_one_way_and_keep_other_dims_exact():
    # A shipped key leads with the count that changes with every batch (tokens, rows or
    # chunks; the row_id_map kernels' expert count is no such count): that one is bucketed.
    from te_jax_perm.ops import shipped_decls
    for name, decl in shipped_decls().items():
        for dim in decl.key_dims:
            got = [decl.key_bucket(dim, v) for v in (0, 1, 3, 100, 128, 129)]
            bucketed = dim == decl.key_dims[0] and dim in ("T", "N", "M", "C")
            want = [1, 1, 4, 128, 128, 256] if bucketed else [0, 1, 3, 100, 128, 129]
            assert got == want, f"{name} buckets key dim {dim} as {got}; expected {want}"


def test_key_changes_with_kernel_source():
    import dataclasses
    decl = K.accumulate_decl()
    other = dataclasses.replace(decl, kernel=K.copy_rows_kernel)
    assert _key(decl)["source"] != _key(other)["source"]


def test_key_changes_with_the_source_of_a_body_the_kernel_calls(tmp_path, monkeypatch):
    """Two kernels whose wrappers read the same, calling bodies that differ, get different
    keys: a tuned entry never outlives a change to a shared body."""
    import dataclasses
    import importlib
    wrapper = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef _body(p):\n"
               "    tl.store(p, tl.load(p) {op} 1)\n\n\n@triton.jit\ndef kernel(p):\n    _body(p)\n")
    for name, op in (("body_plus", "+"), ("body_minus", "-")):
        (tmp_path / f"{name}.py").write_text(wrapper.format(op=op))
    monkeypatch.syspath_prepend(str(tmp_path))
    plus, minus = (importlib.import_module(m).kernel for m in ("body_plus", "body_minus"))
    decl = K.accumulate_decl()
    assert _key(dataclasses.replace(decl, kernel=plus))["source"] != \
        _key(dataclasses.replace(decl, kernel=minus))["source"]


def test_value_outside_key_does_not_retune_and_key_values_do():
    decl = K.accumulate_decl(name="p2", params=("mode", "tag"), key_params=("mode",))
    autotune.tune(decl, [((64, 16), np.float32)], {"mode": 1, "tag": "a"}, backend="interpret")
    assert autotune.stats["tunes"] == 1
    autotune.tune(decl, [((40, 12), np.float32)], {"mode": 1, "tag": "b"}, backend="interpret")  # same buckets, tag not in key
    assert autotune.stats["tunes"] == 1 and autotune.stats["cache_hits"] == 1
    for shapes, params in [([((65, 16), np.float32)], {"mode": 1, "tag": "a"}),
                           ([((64, 16), np.float16)], {"mode": 1, "tag": "a"}),
                           ([((64, 16), np.float32)], {"mode": 2, "tag": "a"})]:
        before = autotune.stats["tunes"]
        autotune.tune(decl, shapes, params, backend="interpret")
        assert autotune.stats["tunes"] == before + 1


def test_inplace_accumulate_applied_once_after_tuning_many_configs():
    """out += x over >= 8 configs must leave out == out0 + x: saved/restored per the alias plan."""
    decl = K.accumulate_decl()
    assert alias_plan(decl).input_output_aliases == {1: 0}  # the prealloc operand, the one a launch writes
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 16)).astype(np.float32)
    out0 = rng.standard_normal((64, 16)).astype(np.float32)
    runner = HostRunner(decl, [x], [out0.copy()], {})
    results = run_trials(decl, runner, K.SAFE_CONFIGS, [out0 + x], reps=2)
    assert len(results) >= 8 and all(r.time_s is not None for r in results), [r.rejected for r in results]
    np.testing.assert_array_equal(runner.buffers[1], out0)   # restored after the last trial
    np.testing.assert_array_equal(runner.buffers[0], x)      # the read-only operand untouched
    best = min((r for r in results), key=lambda r: r.time_s).config
    runner.launch(best)                                      # the real launch that follows tuning
    np.testing.assert_array_equal(runner.buffers[1], out0 + x)  # exactly one application


def test_without_restore_trials_would_accumulate():
    """The check above can fail: skipping the save/restore makes later trials see n*x."""
    decl = K.accumulate_decl()
    x = np.ones((64, 16), np.float32)
    runner = HostRunner(decl, [x], [np.zeros_like(x)], {})
    runner.save = lambda idx: None  # no buffers saved
    results = run_trials(decl, runner, K.SAFE_CONFIGS[:3], [x])
    assert results[0].rejected is None and all(r.rejected for r in results[1:])


def test_racy_config_rejected_by_output_validation():
    # A buggy declaration without the tiling constraint: only output validation can save us.
    # (Whether the racy config also times fastest is left out: wall-time order on a shared
    # CPU is noise, and the rejection must hold whatever the timings are.)
    decl = K.accumulate_decl(name="racy", configs=K.SAFE_CONFIGS + (K.RACY_CONFIG,), constraints=(),
                             default_config=lambda d, p: Config.make(BS=16, BT=4))
    res = autotune.tune(decl, SHAPE, options=autotune.TuneOptions(reps=3, warmup=1), backend="interpret")
    rejected = {Config.from_json(c): (why, t) for c, why, t in res.entry["rejected"]}
    assert set(rejected) == {K.RACY_CONFIG}
    assert "outside rtol" in rejected[K.RACY_CONFIG][0]
    assert rejected[K.RACY_CONFIG][1] > 0  # it was run and timed, then refused
    assert res.best != K.RACY_CONFIG and res.best in K.SAFE_CONFIGS


def test_outputs_are_checked_bitwise_for_exact_kernels_and_integers_within_tolerance_otherwise():
    import types

    import ml_dtypes

    from te_jax_perm.autotune.trials import mismatch
    outs = tuple(types.SimpleNamespace(name=n) for n in ("rows", "ids"))
    exact = types.SimpleNamespace(outputs=outs, exact=True, rtol=1e-2, atol=1e-2)
    summed = types.SimpleNamespace(outputs=outs, exact=False, rtol=1e-2, atol=1e-2)
    w = [np.array([1.0, 2.0], ml_dtypes.bfloat16), np.array([3, 4], np.int32)]
    near = [np.array([1.0, 2.015625], ml_dtypes.bfloat16), np.array([3, 4], np.int32)]
    assert mismatch(summed, near, w) is None and mismatch(exact, w, w) is None
    assert "differ bitwise" in mismatch(exact, near, w)
    assert "ids" in mismatch(summed, [near[0], np.array([3, 5], np.int32)], w)  # integers: always bitwise
    assert "outside rtol" in mismatch(summed, [np.array([1.0, 2.5], ml_dtypes.bfloat16), w[1]], w)
    assert mismatch(summed, [near[0], np.array([3, 4], np.int64)], w)   # another dtype never matches


def test_summed_outputs_are_judged_against_the_outputs_largest_magnitude():
    """Dot products over 7168 terms summed in two orders (as two warp counts sum them): the
    sums that cancel to near zero differ by more than rtol=atol=1e-5 of themselves, which
    an element-wise test calls wrong; against the output's largest magnitude they agree. A
    wrong, missing or doubled element is still refused."""
    import types

    import ml_dtypes

    from te_jax_perm.autotune.trials import mismatch
    rng = np.random.default_rng(0)
    g, y = (rng.standard_normal((1024, 7168)).astype(ml_dtypes.bfloat16).astype(np.float32) for _ in "gy")
    terms = g * y
    one = terms.reshape(1024, 56, 128).sum(axis=2).sum(axis=1)
    other = terms.reshape(1024, 128, 56).sum(axis=1).sum(axis=1)
    assert (~np.isclose(one, other, rtol=1e-5, atol=1e-5)).sum() > 0   # the element-wise test refuses
    decl = types.SimpleNamespace(outputs=(types.SimpleNamespace(name="dw"),), exact=False, rtol=1e-5, atol=1e-5)
    assert mismatch(decl, [other], [one]) is None
    swapped, zeroed, doubled = other.copy(), other.copy(), other.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    zeroed[7] = 0.0
    doubled[9] *= 2
    for bad in (swapped, zeroed, doubled):
        assert "outside rtol" in mismatch(decl, [bad], [one])
    inf_nan = np.array([np.inf, -np.inf, np.nan, 1.0], np.float32)
    assert mismatch(decl, [inf_nan], [inf_nan]) is None
    assert mismatch(decl, [inf_nan[::-1].copy()], [inf_nan])
    assert mismatch(decl, [np.array([np.nan, 1.0], np.float32)], [np.array([0.0, 1.0], np.float32)])


def test_empty_output_garbage_is_caught():
    """init='empty' buffers start as random bytes, so a config writing too few rows fails."""
    buf = initial_prealloc(False, (4, 4), np.float32, seed=3)
    assert np.any(buf != 0)
    np.testing.assert_array_equal(initial_prealloc(True, (2,), np.int32), 0)


def test_warm_cache_reuse_across_processes(tmp_cache):
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
        import numpy as np
        from tests import _autotune_kernels as K
        from te_jax_perm import autotune
        autotune.set_cache_dir({str(tmp_cache)!r})
        r = autotune.tune(K.accumulate_decl(), [((64, 16), np.float32)], backend="interpret")
        print(json.dumps({{"stats": dict(autotune.stats), "cached": r.cached, "best": str(r.best)}}))
    """)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert not runs[0]["cached"] and runs[0]["stats"]["trials"] >= 8
    assert runs[1]["cached"] and runs[1]["stats"].get("trials", 0) == 0 and runs[1]["stats"].get("compiles", 0) == 0
    assert runs[0]["best"] == runs[1]["best"]
    files = list(tmp_cache.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["kernel"] == "test_accumulate"
    assert "test_accumulate" in autotune.format_cache()


def test_concurrent_writers_leave_a_complete_file(tmp_cache):
    k = _key(K.accumulate_decl())
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from te_jax_perm.autotune import cache
        cache.set_cache_dir({str(tmp_cache)!r})
        for i in range(200):
            cache.store({k!r}, {{"best": None, "ranking": [[{{"constants": {{}}, "num_warps": 4, "num_stages": 1}}, i]] * 50, "writer": {w}}})
    """)], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))) for w in range(3)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    entry = cache.load(k)
    assert entry is not None and entry["writer"] in (0, 1, 2) and len(entry["ranking"]) == 50
    assert not list(tmp_cache.glob("*.tmp"))


def test_resolver_tunes_on_miss_when_enabled_and_uses_cache_when_disabled(on_cpu):
    decl = K.accumulate_decl(name="resolved", default_config=lambda d, p: Config.make(BS=16, BT=2))
    prim = declare(decl)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((48, 10)).astype(np.float32))
    with autotune.autotuning(False):
        (y,) = prim(x, backend="interpret")
    assert autotune.stats["tunes"] == 0
    np.testing.assert_allclose(np.asarray(y), np.asarray(x))
    with autotune.autotuning(True):
        (y,) = jax.jit(lambda a: prim(a, backend="interpret"))(x)
    assert autotune.stats["tunes"] == 1 and autotune.stats["trials"] >= 8
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))  # out(=0) += x applied exactly once
    entry = cache.load(cache.make_key(decl, {"T": 48, "H": 10}, {}, [np.float32], "interpret"))
    best = autotune.resolve(decl, [x], {}, "interpret")
    assert best is not None and best.to_json() == entry["best"]
    with autotune.autotuning(False):  # disabled: the cached winner is still used, nothing re-tuned
        assert autotune.resolve(decl, [jax.ShapeDtypeStruct((40, 12), np.float32)], {}, "interpret") == best
    assert autotune.stats["tunes"] == 1


def _jitted_prim(name):
    """A jitted call of a fresh kernel on a 48-row input whose default config runs 3
    programs: ``(call, tuning setting each trace saw, its declaration, the input)``; the
    call checks its result."""
    decl = K.accumulate_decl(name=name, default_config=lambda d, p: Config.make(BS=16, BT=2))
    prim = declare(decl)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((48, 10)).astype(np.float32))
    traced = []
    f = jax.jit(lambda a: (traced.append(autotune.enabled()), prim(a, backend="interpret"))[1])

    def call():
        (y,) = f(x)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))   # out(=0) += x applied once
    return call, traced, decl, x


def test_jit_lowers_again_inside_an_autotuning_block_and_tunes(on_cpu):
    # Lowered with tuning off, a jitted function keeps the default config; called inside
    # autotuning() it is lowered again (jit's cache keys on the block), tunes the miss and
    # runs the winner. Back outside, the first lowering is still cached.
    from tests.launches import recorded_launches
    call, traced, decl, x = _jitted_prim("jit_block")
    ran = []
    with recorded_launches() as launches:
        for on in (False, True, False):
            with autotune.autotuning(on):
                call()
            ran.append(launches[-1][1])   # the call's own launch's grid (tuning trials come before it)
    assert traced == [False, True], f"traced with tuning {traced}; expected once off, once on"
    assert autotune.stats["tunes"] == 1, f"{autotune.stats['tunes']} tunings; the call inside the block must tune"
    best = autotune.resolve(decl, [x], {}, "interpret")
    assert ran == [(3, 1, 1), (-(-48 // best.kw["BS"]), 1, 1), (3, 1, 1)], \
        f"grids launched {ran}; expected the default's, the tuned {best}'s, the default's"


def test_jit_lowers_again_after_enable_and_tunes(on_cpu):
    # The process-wide switch is in jit's cache key too.
    call, traced, _decl, _x = _jitted_prim("jit_enable")
    before = autotune.enabled()
    try:
        autotune.enable(False)
        call()
        autotune.enable(True)
        call()
    finally:
        autotune.enable(before)
    assert traced == [False, True], f"traced with tuning {traced}; expected once before enable(True), once after"
    assert autotune.stats["tunes"] == 1, f"{autotune.stats['tunes']} tunings; the call after enable(True) must tune"


def test_enable_inside_autotuning_blocks_outlasts_them():
    before = autotune.enabled()
    try:
        with autotune.autotuning(False):
            with autotune.autotuning(True):
                autotune.enable(not before)   # for the process: after the blocks
                assert autotune.enabled()      # the innermost block still decides here
            assert not autotune.enabled()      # the outer block again
        assert autotune.enabled() is (not before)
    finally:
        autotune.enable(before)


def test_cached_winner_invalid_for_exact_dims_is_skipped(tmp_cache):
    decl = K.accumulate_decl(name="bucket", constraints=(K.tiles_own_rows, K.not_wider_than_rows))
    autotune.tune(decl, [((64, 16), np.float32)], backend="interpret")
    k = cache.make_key(decl, {"T": 64, "H": 16}, {}, [np.float32], "interpret")
    entry = cache.load(k)
    entry["ranking"].insert(0, [Config.make(BS=64, BT=4).to_json(), 0.0])
    cache.store(k, entry)
    # A winner valid at the tuned T=64 may violate a constraint at another T; pick skips it.
    from te_jax_perm.autotune.tuner import pick
    assert pick(decl, entry, {"T": 64, "H": 16}, {}) == Config.make(BS=64, BT=4)
    assert pick(decl, entry, {"T": 32, "H": 16}, {}) != Config.make(BS=64, BT=4)


def _tune_inside_a_mesh_context(backend, devices, context):
    """A fresh kernel (out(=0) += x) called with tuning on while another program is traced
    with a mesh in context: inside a jitted shard_map's body, or a jit under ``jax.set_mesh``.
    The trials, programs of their own, must compile and run there all the same."""
    from jax.sharding import Mesh, PartitionSpec as P
    prim = declare(K.accumulate_decl(name=f"tuned_in_{context}_{backend}"))
    mesh = Mesh(np.array(devices[:1]), ("d",))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((48, 10)).astype(np.float32), device=devices[0])
    call = lambda a: prim(a, backend=backend)[0]   # noqa: E731
    with autotune.autotuning(True):
        if context == "shard_map":
            y = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)
        else:
            with jax.set_mesh(mesh):
                y = jax.jit(call)(x)
    assert autotune.stats["tunes"] == 1 and autotune.stats["trials"] >= 2, dict(autotune.stats)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))   # applied exactly once


@pytest.mark.parametrize("context", ["shard_map", "set_mesh"])
def test_tunes_on_miss_with_a_mesh_in_context(tmp_cache, on_cpu, context):
    _tune_inside_a_mesh_context("interpret", jax.devices("cpu"), context)


@pytest.mark.gpu
@pytest.mark.parametrize("context", ["shard_map", "set_mesh"])
def test_gpu_tunes_on_miss_with_a_mesh_in_context(tmp_cache, context):
    _tune_inside_a_mesh_context("triton", jax.devices("gpu"), context)


@pytest.mark.gpu
def test_gpu_trials_restore_donated_buffers_and_need_no_torch(tmp_path):
    """On the GPU, trials run through the backend's own XLA call with torch unimportable:
    out += x tuned over >= 8 configs, then launched once, leaves out == out0 + x; a whole
    tune writes its cache entry."""
    script = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import numpy as np
        from tests import _autotune_kernels as K
        from te_jax_perm import autotune
        from te_jax_perm.autotune.trials import GpuRunner
        from te_jax_perm.autotune.trials import run_trials
        decl = K.accumulate_decl()
        rng = np.random.default_rng(0)
        x = rng.standard_normal((64, 16)).astype(np.float32)
        out0 = rng.standard_normal((64, 16)).astype(np.float32)
        runner = GpuRunner(decl, [x], [out0.copy()], {})
        results = run_trials(decl, runner, K.SAFE_CONFIGS, [out0 + x], reps=3, warmup=1)
        assert len(results) >= 8, len(results)
        assert all(r.time_s is not None for r in results), [(r.rejected, r.error) for r in results]
        np.testing.assert_array_equal(runner.outputs()[0], out0)  # restored after the last trial
        runner.launch(min(results, key=lambda r: r.time_s).config)
        np.testing.assert_array_equal(runner.outputs()[0], out0 + x)  # exactly one application
        res = autotune.tune(decl, [((64, 16), np.float32)], backend="triton")
        assert res.entry["complete"] and res.best is not None and not res.entry["rejected"], res.entry
        assert autotune.cache.load(res.key, decl, res.entry["tuned_dims"], {}) is not None
        print("ok", len(res.entry["ranking"]))
    """)
    env = dict(os.environ, TE_JAX_PERM_AUTOTUNE_CACHE=str(tmp_path / "cache"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
