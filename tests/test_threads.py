"""Several Python threads calling the library at once, as a server's request threads do.

Each test starts its threads together (a ``threading.Barrier``) so that first calls
(tracing, lowering, config selection, tuning) overlap, and checks the results against
single-threaded ones, that no exception escapes a thread, and that one thread's scopes
(``use_backend``, ``autotuning``, ``sanitize``) do not change what another thread does.
Shapes are small: the interpreter runs one program at a time, and launches from all
threads take turns (``source_lock``).
"""
import collections
import json
import logging
import pathlib
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import te_jax_perm
from tests import _autotune_kernels as K
from tests.conftest import routing
from te_jax_perm import autotune
from te_jax_perm.autotune import cache, tuner
from te_jax_perm.core import Config, declare, hooks, resolve_backend, use_backend
from te_jax_perm.sanitize import sanitize

CPU = jax.devices("cpu")[0]
N_THREADS = 4


def run_threads(fns, timeout_s=120.0):
    """Runs each of ``fns`` in its own thread, all released at once by a barrier (the
    function gets it, to meet the others again); returns their results in order and raises
    the first exception any of them raised."""
    barrier = threading.Barrier(len(fns))
    results, errors = [None] * len(fns), [None] * len(fns)

    def body(i, fn):
        try:
            with jax.default_device(CPU):   # the interpreter runs on host buffers
                barrier.wait()
                results[i] = fn(barrier)
        except BaseException as e:  # noqa: BLE001 - handed to the test below
            errors[i] = e
            barrier.abort()   # a thread waiting on the barrier fails too instead of hanging

    threads = [threading.Thread(target=body, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), f"a thread did not finish in {timeout_s} s"
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                 next((e for e in errors if e is not None), None))
    if first is not None:
        raise first
    return results


# -- the ops, each a small first call of its own ------------------------------------------------
RNG = np.random.default_rng(0)
T, E, K_TOP, H = 16, 4, 2, 24
X = RNG.standard_normal((T, H)).astype(np.float32)
ROUTING = routing(RNG, T, E, K_TOP)
PROBS = (RNG.random((T, E)) * ROUTING).astype(np.float32)
SPLITS, ORDER = np.array([5, 3, 6, 2], np.int32), np.array([2, 0, 3, 1], np.int32)
W = RNG.standard_normal((E, H, 8)).astype(np.float32)
GROUPS = np.array([4, 0, 7, 5], np.int32)


def dispatch_combine(backend, x=X):
    out, probs, rid, _, _ = te_jax_perm.token_dispatch(x, ROUTING, T * K_TOP, probs=PROBS, backend=backend)
    return out, probs, te_jax_perm.token_combine(out, rid, PROBS, backend=backend)


OPS = {
    "sort_chunks": lambda b, x=X: te_jax_perm.sort_chunks_by_index(x, SPLITS, ORDER, backend=b),
    "row_id_map": lambda b, x=X: te_jax_perm.make_row_id_map(ROUTING, T * K_TOP, backend=b),
    "dispatch_combine": dispatch_combine,
    "grouped_matmul": lambda b, x=X: te_jax_perm.grouped_matmul(x, W, GROUPS, backend=b),
}


def as_numpy(tree):
    return jax.tree.map(np.asarray, tree)


def assert_trees_equal(got, want, what):
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"{what}: leaf {i}")


def test_concurrent_first_calls_of_different_ops_match_the_xla_backend():
    # Every op on both backends, eagerly and under jit, each call a first lowering of its
    # own and each in a thread of its own. Triton parses a kernel's source at the kernel's
    # first hash (its tuning key) and the interpreter at its first launch, and CPython
    # 3.11's parser is not safe for threads parsing at once ("SystemError: AST constructor
    # recursion depth mismatch", about once in ten runs of this test when the key's parse
    # was not under the interpreter's lock).
    jobs = [(name, op, backend, jitted) for name, op in OPS.items() for backend in ("xla", "interpret")
            for jitted in (False, True)]

    def run_one(name, op, backend, jitted):
        f = jax.jit(lambda x: op(backend, x)) if jitted else (lambda x: op(backend, x))
        return as_numpy(f(jnp.asarray(X)))

    got = run_threads([lambda _barrier, j=j: run_one(*j) for j in jobs])
    for (name, op, backend, jitted), g in zip(jobs, got):
        with jax.default_device(CPU):   # where the threads ran: a GPU would multiply float32 in TF32
            want = as_numpy(op("xla"))
        assert_trees_equal(g, want, f"{name} on {backend} ({'jit' if jitted else 'eager'})")


def test_use_backend_scopes_stay_in_their_thread():
    # Each thread holds its own scope while the others hold theirs, and lowers a function
    # inside it: only the interpreter's lowering holds the kernel's custom call.
    names = ["interpret", "xla"] * (N_THREADS // 2)

    def job(name):
        def run(barrier):
            # The thread's own default before its scope ("triton" for computations placed on
            # a GPU, else "xla"): the scope must close back to it.
            default = resolve_backend()
            with use_backend(name):
                barrier.wait()   # every thread is inside its scope now
                seen = resolve_backend()
                text = jax.jit(lambda x: te_jax_perm.sort_chunks_by_index(x, SPLITS, ORDER)).lower(X).as_text()
                barrier.wait()   # no thread leaves its scope before all have looked
            return seen, "custom_call" in text, resolve_backend(), default
        return run

    for name, (seen, custom_call, after, default) in zip(names, run_threads([job(n) for n in names])):
        assert seen == name, f"inside use_backend({name!r}) the backend resolved to {seen!r}"
        assert custom_call is (name == "interpret"), f"use_backend({name!r}) lowered with custom call {custom_call}"
        assert after == default, f"after use_backend({name!r}) closed, the backend is {after!r}, not {default!r}"


def test_threads_started_inside_a_block_start_outside_it():
    # A scope holds for the thread that opened it: a thread started inside it (here, one of
    # each scope) sees the process's setting, not the block's.
    def seen():
        return resolve_backend(), autotune.enabled()

    outside = seen()
    other = "interpret" if outside[0] == "xla" else "xla"
    with use_backend(other), autotune.autotuning(not outside[1]):
        assert seen() == (other, not outside[1])
        got = []
        t = threading.Thread(target=lambda: got.append(seen()))
        t.start()
        t.join(60)
    assert got == [outside], f"a thread started inside the blocks saw {got}, not the process's {outside}"


# -- the autotuner --------------------------------------------------------------------------------
def test_autotuning_blocks_stay_in_their_thread():
    # Two threads' blocks overlap and close in the order they opened (not nested): each
    # thread sees its own block's setting, a thread outside any block sees the process's,
    # and afterwards nothing of either block is left.
    before = autotune.enabled()

    def first(barrier):
        with autotune.autotuning(not before):
            barrier.wait()                   # 1: the second thread is outside any block
            barrier.wait()                   # 2: it looked
            barrier.wait()                   # 3: it opened its own block
            mine = autotune.enabled()
        barrier.wait()                       # 4: this block closed first
        return mine

    def second(barrier):
        barrier.wait()
        outside = autotune.enabled()
        barrier.wait()
        with autotune.autotuning(before):
            barrier.wait()
            barrier.wait()
            mine = autotune.enabled()
        return outside, mine

    mine_first, (outside, mine_second) = run_threads([first, second])
    assert mine_first is (not before), "a thread's autotuning() block was changed by another thread's"
    assert outside is before, "a thread outside any autotuning() block saw another thread's block"
    assert mine_second is before, "a thread's autotuning() block was changed by another thread's"
    assert autotune.enabled() is before, "autotuning() blocks of two threads left their setting behind"



def test_threads_tuning_one_key_tune_it_once(tmp_cache):
    # Every thread misses the cache at once for the same key; one tunes, the others wait
    # for its result instead of timing every config again, and one valid entry is stored.
    decl = K.accumulate_decl(name="threads_one_key", default_config=lambda d, p: Config.make(BS=16, BT=2))
    prim = declare(decl)
    x = np.random.default_rng(2).standard_normal((48, 10)).astype(np.float32)

    def job(jitted):
        def run(_barrier):
            with autotune.autotuning(True):
                f = jax.jit(lambda a: prim(a, backend="interpret")) if jitted else (
                    lambda a: prim(a, backend="interpret"))
                (y,) = f(jnp.asarray(x))
            return np.asarray(y)
        return run

    got = run_threads([job(i % 2 == 0) for i in range(N_THREADS)])
    for y in got:
        np.testing.assert_array_equal(y, x)   # out(=0) += x applied exactly once
    assert autotune.stats["tunes"] == 1, f"{autotune.stats['tunes']} threads tuned the same key; expected 1"
    files = sorted(tmp_cache.glob("*"))
    assert [p.suffix for p in files] == [".json"], f"cache directory holds {files}; expected one entry"
    entry = json.loads(files[0].read_text())
    key = cache.make_key(decl, {"T": 48, "H": 10}, {}, [np.float32], "interpret")
    assert entry["key"] == key and cache.load(key, decl, {"T": 48, "H": 10}, {}) is not None
    # The per-key lock goes once its last user is done: a process tuning many shapes keeps none.
    assert tuner.tunings_in_flight() == 0, "a finished tuning left its key's lock behind"


class SlowCounter(collections.Counter):
    """A counter whose reads take a moment: a thread updating it in two steps (read, then
    write) lets the others read the same count in between."""

    def __getitem__(self, name):
        value = super().__getitem__(name)
        time.sleep(0.002)
        return value


class SlowPath(type(pathlib.Path())):
    """A path whose parent takes a moment to work out: code that works it out again between
    checking a directory and recording it lets the other threads check in between."""

    @property
    def parent(self):
        time.sleep(0.01)
        return super().parent


def test_threads_hitting_the_cache_at_once_count_every_hit(tmp_cache, monkeypatch):
    # Request threads resolving a cached config at once: the counters the CLI and the tests
    # read must count each hit, none lost to another thread's update.
    monkeypatch.setattr(tuner, "stats", SlowCounter())
    decl = K.accumulate_decl(name="threads_counted_hits", default_config=lambda d, p: Config.make(BS=16, BT=2))
    default = Config.make(BS=16, BT=2).to_json()
    key = cache.make_key(decl, {"T": 48, "H": 10}, {}, [np.float32], "interpret")
    cache.store(key, {"best": default, "ranking": [[default, 1e-6]], "tuned_dims": {"T": 48, "H": 10}})
    aval, calls = jax.ShapeDtypeStruct((48, 10), np.float32), 10

    def job(_barrier):
        return [autotune.resolve(decl, [aval], {}, "interpret") for _ in range(calls)]

    for picked in run_threads([job] * N_THREADS):
        assert picked == [Config.make(BS=16, BT=2)] * calls
    assert tuner.stats["cache_hits"] == N_THREADS * calls, dict(tuner.stats)


def test_threads_meeting_an_unusable_cache_at_once_warn_once(tmp_path, monkeypatch, caplog):
    # Under a cache directory that is a file, every thread's lookup fails and every store is
    # kept in memory: one warning of each kind for the process, not one for each thread.
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(cache, "cache_dir", lambda: SlowPath(blocker / "cache"))
    decl = K.accumulate_decl(name="threads_unusable_cache")
    key = cache.make_key(decl, {"T": 48, "H": 10}, {}, [np.float32], "interpret")
    caplog.set_level(logging.WARNING)

    def job(i):
        def run(_barrier):
            mine = {**key, "source": f"thread {i}"}   # a file of its own for each thread
            missed = cache.load(mine, decl, {"T": 48, "H": 10}, {})
            _barrier.wait()
            cache.store(mine, {"best": None, "ranking": []})
            return missed
        return run

    assert run_threads([job(i) for i in range(N_THREADS)]) == [None] * N_THREADS
    for text in ("the cache directory is not a directory", "cannot write the tuning cache"):
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]
        assert len(warned) == 1, f"{len(warned)} warnings '{text}' from {N_THREADS} threads; expected 1"


# -- errors raised inside a launch ----------------------------------------------------------------
def test_threads_failing_the_same_way_each_get_their_own_error():
    # A kernel's error is raised in XLA's host callback, which XLA hands on only as text; the
    # eager call finds the error again by that text. Threads failing with the same text at
    # once must each get the error itself, not XLA's runtime error quoting it.
    from tests.planted_kernels import broken_store

    def job(_barrier):
        seen = []
        for _ in range(4):
            try:
                broken_store(jnp.zeros((8,), jnp.float32), backend="interpret")
                seen.append(None)
            except Exception as e:  # noqa: BLE001 - the test looks at which exception arrived
                seen.append(type(e).__name__)
        return seen

    for seen in run_threads([job] * 8):
        assert seen == ["ValueError"] * 4, f"a thread's failing calls raised {seen}; expected ValueError each time"


# -- the sanitizer ---------------------------------------------------------------------------------
def test_sanitizer_scopes_in_some_threads_leave_the_others_results_and_close_cleanly():
    # Sanitized threads open and close their scopes while plain threads run the same ops;
    # every result is right, no shipped kernel is reported, each sanitized thread's report
    # holds its own launches, and once every scope is closed no observer is left behind
    # (which would slow every later launch in the process by the recording).
    op = OPS["sort_chunks"]
    want = as_numpy(op("xla"))

    def sanitized(_barrier):
        with sanitize() as report:
            got = [as_numpy(op("interpret")), as_numpy(jax.jit(lambda x: op("interpret", x))(jnp.asarray(X)))]
        return got, report

    def plain(backend):
        return lambda _barrier: ([as_numpy(op(backend)), as_numpy(jax.jit(lambda x: op(backend, x))(jnp.asarray(X)))],
                                 None)

    jobs = [sanitized, plain("interpret"), sanitized, plain("xla")]
    for i, (got, report) in enumerate(run_threads(jobs)):
        for g in got:
            assert_trees_equal(g, want, f"thread {i}")
        if report is not None:
            assert not report, report.text()
            assert {s.kernel for s in report.launches} >= {"sort_chunks"}, report.launches
    assert hooks.launch_observers() == (), "sanitizer scopes closed in threads left a launch observer registered"


# -- the expert-parallel exchange's probe --------------------------------------------------------
def test_threads_asking_whether_ragged_runs_probe_once_and_survive_a_forget(monkeypatch):
    # Request threads tracing the expert-parallel layer at once ask the same question: one
    # probe answers them all, and a forget_probes() in between takes no thread's answer away.
    import time
    from te_jax_perm.parallel import a2a_support

    calls = []

    def slow_probe(devices):
        calls.append(devices)
        time.sleep(0.05)   # long enough for every thread to arrive while it runs
        return False

    monkeypatch.setattr(a2a_support, "probe", slow_probe)
    a2a_support.forget_probes()
    devices = (CPU,)

    def asker(barrier):
        first = a2a_support.ragged_all_to_all_supported(devices)
        barrier.wait()
        return first, a2a_support.ragged_all_to_all_supported(devices)

    def forgetter(barrier):
        barrier.wait()
        a2a_support.forget_probes()
        return False, False

    try:
        answers = run_threads([asker] * N_THREADS + [forgetter])
    finally:
        a2a_support.forget_probes()
    assert all(a == (False, False) for a in answers), answers
    assert 1 <= len(calls) <= 2, f"{len(calls)} probes for one question asked by {N_THREADS} threads (2 at most: one forget)"
