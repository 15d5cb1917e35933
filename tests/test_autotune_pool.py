"""Crash-isolated compiles: planted aborts/segfaults/hangs fail one config, never the tuner."""
import os
import time

import numpy as np
import pytest

from tests import _autotune_kernels as K
from te_jax_perm import autotune
from te_jax_perm.autotune.pool import CompilePool, make_job
from te_jax_perm.core import Config

pytest.importorskip("triton")
TARGET = ("cuda", 90, 32)  # Triton compiles for a GPU target without a GPU
SHAPE = [((64, 16), np.float32)]


@pytest.fixture(autouse=True)
def tmp_caches(tmp_path, monkeypatch):
    autotune.set_cache_dir(tmp_path / "tune")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    autotune.stats.clear()
    yield
    autotune.set_cache_dir(None)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = CompilePool(workers=2, timeout_s=60, cache_dir=str(tmp_path_factory.mktemp("triton_shared")))
    yield p
    p.close()


def _jobs(decl, configs, faults=None):
    import jax
    from te_jax_perm.core import bind_call, configure
    call = bind_call(decl, [jax.ShapeDtypeStruct((64, 16), np.float32)], {}, "triton")
    faults = faults or {}
    jobs = [make_job(configure(call, c), TARGET) for c in configs]
    return [K.crashing(j, faults[c]) if c in faults else j for j, c in zip(jobs, configs)]


@pytest.mark.parametrize("kind", ["abort", "segfault", "raise"])
def test_crashing_config_is_skipped_and_pool_recovers(pool, kind):
    decl = K.accumulate_decl()
    cfgs = list(K.SAFE_CONFIGS[:4])
    replaced = pool.replaced
    res = pool.compile_many(_jobs(decl, cfgs, {cfgs[1]: kind}))
    assert [r.ok for r in res] == [True, False, True, True]
    assert ("died" in res[1].error) if kind != "raise" else ("planted compile error" in res[1].error)
    assert pool.replaced == replaced + (kind != "raise")
    assert all(r.info["binary"] for r in res if r.ok)  # the cubin comes back to the parent
    res2 = pool.compile_many(_jobs(decl, cfgs[:2]))   # the replaced worker keeps serving
    assert all(r.ok for r in res2)


def test_hanging_compile_times_out(tmp_path):
    p = CompilePool(workers=1, timeout_s=3.0, cache_dir=str(tmp_path / "t"))
    try:
        decl = K.accumulate_decl()
        cfgs = list(K.SAFE_CONFIGS[:2])
        t0 = time.monotonic()
        res = p.compile_many(_jobs(decl, cfgs, {cfgs[0]: "hang"}))
        assert not res[0].ok and "timed out" in res[0].error
        assert res[1].ok and p.replaced == 1
        assert time.monotonic() - t0 < 60
    finally:
        p.close()


def test_tune_survives_a_compile_abort_and_skips_that_config(monkeypatch):
    from te_jax_perm.autotune import tuner
    decl = K.accumulate_decl(name="crashy")
    bad = K.SAFE_CONFIGS[-1]
    pid = os.getpid()
    make_job = tuner.make_job
    monkeypatch.setattr(tuner, "make_job", lambda launch, target: (
        K.crashing(make_job(launch, target), "abort") if launch.config == bad else make_job(launch, target)))
    res = autotune.tune(decl, SHAPE, options=autotune.TuneOptions(compile_target=TARGET))
    assert os.getpid() == pid
    failed = {Config.from_json(c): why for c, why in res.entry["failed"]}
    assert set(failed) == {bad} and "exit code" in failed[bad]
    timed = {Config.from_json(c) for c, _ in res.entry["ranking"]}
    assert bad not in timed and len(timed) == len(K.SAFE_CONFIGS)  # 7 safe + the default
    assert autotune.stats["compiles"] == len(K.SAFE_CONFIGS) + 1


def test_parent_loads_worker_binary_without_recompiling(pool, monkeypatch):
    """The backend's compile of a config the pool compiled is a Triton cache hit."""
    import jax
    from te_jax_perm.core import bind_call, configure, triton_backend
    decl = K.accumulate_decl()
    launch = configure(bind_call(decl, [jax.ShapeDtypeStruct((64, 16), np.float32)], {}, "triton"),
                       Config.make(BS=16, BT=8, num_warps=2))
    (res,) = pool.compile_many([make_job(launch, TARGET)])
    assert res.ok
    monkeypatch.setenv("TRITON_CACHE_DIR", pool.cache_dir)
    from triton.compiler import ASTSource

    def no_compile(*a, **k):
        raise AssertionError("parent recompiled instead of loading the worker's binary")
    monkeypatch.setattr(ASTSource, "make_ir", no_compile)
    triton_backend.compile_cached.cache_clear()
    assert triton_backend.compiled_for(launch, TARGET[1]).name
