"""The tuning cache as an adversary writes it: every entry is checked against the
declaration before use, bad ones are reported once, ignored and re-tuned; --print_cache
survives any file; an unwritable cache keeps results in memory."""
import json
import logging
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import _autotune_kernels as K
from te_jax_perm import autotune
from te_jax_perm.autotune import cache
from te_jax_perm.core import Config, declare

# The interpret backend runs on host buffers: on a GPU machine too, these run on the CPU.
pytestmark = pytest.mark.usefixtures("on_cpu", "tmp_cache")

SHAPE = (48, 10)


def _cfg(**kw):
    return {"constants": kw, "num_warps": 4, "num_stages": 1}


def _setup(name):
    decl = K.accumulate_decl(name=name, default_config=lambda d, p: Config.make(BS=16, BT=2))
    key = cache.make_key(decl, {"T": SHAPE[0], "H": SHAPE[1]}, {}, [np.float32], "interpret")
    return decl, declare(decl), key


def _write_entry(key, ranking, **extra):
    cache.store(key, {"best": ranking[0][0] if ranking else None, "ranking": ranking, "tuned_dims": {"T": 48, "H": 10},
                      **extra})


def _absl_warnings(caplog, text):
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


BAD_CONFIGS = {
    "unknown_constexpr": _cfg(BS=8, BT=2, BOGUS=1),
    "zero_tile": _cfg(BS=8, BT=0),
    "non_power_of_2": _cfg(BS=12, BT=4),
    "float": _cfg(BS=8.0, BT=2),
    "bool_for_int": _cfg(BS=8, BT=True),
    "missing_field": {"constants": {"BS": 8, "BT": 2}, "num_warps": 4},
    "string_warps": {"constants": {"BS": 8, "BT": 2}, "num_warps": "4", "num_stages": 1},
    "not_a_dict": [8, 2],
}


@pytest.mark.parametrize("bad", sorted(BAD_CONFIGS))
def test_bad_config_is_ignored_reported_once_and_retuned(bad, caplog):
    decl, prim, key = _setup(f"cache_bad_{bad}")
    _write_entry(key, [[BAD_CONFIGS[bad], 1e-6], [_cfg(BS=8, BT=2), 2e-6]])
    x = jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32))
    caplog.set_level(logging.WARNING)
    with autotune.autotuning(False):
        for _ in range(2):
            assert autotune.resolve(decl, [x], {}, "interpret") is None   # the default, not the entry
        (y,) = prim(x, backend="interpret")                               # the user's call still works
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert len(_absl_warnings(caplog, "ignoring the cached result")) == 1, caplog.text
    assert autotune.stats["tunes"] == 0
    with autotune.autotuning(True):
        best = autotune.resolve(decl, [x], {}, "interpret")
    assert autotune.stats["tunes"] == 1 and best is not None
    entry = cache.load(key)   # the bad file was replaced by a real tuning result
    canon = {json.dumps(c, sort_keys=True) for c, _ in entry["ranking"]}
    assert best.to_json() == entry["best"] and json.dumps(BAD_CONFIGS[bad], sort_keys=True) not in canon
    with autotune.autotuning(False):
        assert autotune.resolve(decl, [x], {}, "interpret") == best


BAD_FILES = {
    "non_utf8": b"\xff\xfe{\x00",
    "null": b"null",
    "list": b"[1, 2]",
    "truncated": b'{"best": {"constants": {',
    "ranking_not_list": json.dumps({"ranking": {"a": 1}, "best": None}).encode(),
    "time_not_number": None,   # filled with the key below
    "nan_time": None,
}


@pytest.mark.parametrize("bad", sorted(BAD_FILES))
def test_bad_file_is_ignored_and_retuned(bad, caplog):
    decl, prim, key = _setup(f"cache_file_{bad}")
    path = cache.entry_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    content = BAD_FILES[bad]
    if bad == "time_not_number":
        content = json.dumps({"key": key, "best": None, "ranking": [[_cfg(BS=8, BT=2), "fast"]]}).encode()
    elif bad == "nan_time":
        content = json.dumps({"key": key, "best": None, "ranking": [[_cfg(BS=8, BT=2), float("nan")]]}).encode()
    path.write_bytes(content)
    x = jnp.asarray(np.ones(SHAPE, np.float32))
    caplog.set_level(logging.WARNING)
    with autotune.autotuning(False):
        assert autotune.resolve(decl, [x], {}, "interpret") is None
        assert autotune.resolve(decl, [x], {}, "interpret") is None
    assert len(_absl_warnings(caplog, "ignoring the cached result")) == 1, caplog.text
    with autotune.autotuning(True):
        assert autotune.resolve(decl, [x], {}, "interpret") is not None
    assert autotune.stats["tunes"] == 1 and cache.load(key) is not None


@pytest.mark.parametrize("kind", ["fifo", "endless", "oversized", "directory"])
def test_entry_that_is_no_regular_file_of_bounded_size_is_skipped_not_read(kind, caplog):
    """A FIFO would block the read until a writer came, /dev/zero never ends: either used to
    hang every lowering (the cache is read even with tuning off)."""
    decl, _, key = _setup(f"cache_special_{kind}")
    path = cache.entry_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":   # once gave a warning per lowering, naming a file descriptor's number
        path.mkdir()
    elif kind == "endless":
        os.symlink("/dev/zero", path)
    else:
        path.write_bytes(b'{"pad": "' + b" " * cache.MAX_ENTRY_BYTES + b'"}')
    caplog.set_level(logging.WARNING)
    results = []

    def resolve_twice():
        with autotune.autotuning(False):
            results.extend(autotune.resolve(decl, [jnp.ones(SHAPE, jnp.float32)], {}, "interpret") for _ in range(2))
    worker = threading.Thread(target=resolve_twice, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert results == [None, None], "the cache read hung" if worker.is_alive() else results
    assert len(_absl_warnings(caplog, "ignoring the cached result")) == 1, caplog.text
    assert "Errno" not in caplog.text and ("not a regular file" in caplog.text or kind == "oversized"), caplog.text
    assert "BAD" in autotune.format_cache() or kind not in ("oversized",)


def test_entries_are_readable_by_every_user_of_a_shared_cache():
    _, _, key = _setup("cache_mode")
    _write_entry(key, [[_cfg(BS=8, BT=2), 1e-6]])
    assert cache.entry_path(key).stat().st_mode & 0o777 == 0o644


def test_valid_entry_with_default_outside_declared_configs_is_used():
    # The tuner adds the default config to the space: a winner equal to it is legitimate
    # even when the declared list does not hold it.
    decl, _, key = _setup("cache_default_winner")
    _write_entry(key, [[_cfg(BS=16, BT=2), 1e-6]])
    x = jnp.ones(SHAPE, jnp.float32)
    assert autotune.resolve(decl, [x], {}, "interpret") == Config.make(BS=16, BT=2)
    assert autotune.stats["cache_hits"] == 1


def test_unwritable_cache_keeps_results_in_memory_and_warns_once(tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    autotune.set_cache_dir(blocker / "cache")      # mkdir fails even for root
    decl = K.accumulate_decl(name="cache_unwritable")
    caplog.set_level(logging.WARNING)
    first = autotune.tune(decl, [((64, 16), np.float32)], backend="interpret")
    assert not first.cached and first.best is not None
    again = autotune.tune(decl, [((64, 16), np.float32)], backend="interpret")
    assert again.cached and again.best == first.best and autotune.stats["tunes"] == 1
    other = autotune.tune(K.accumulate_decl(name="cache_unwritable_2"), [((64, 16), np.float32)], backend="interpret")
    assert not other.cached
    assert len(_absl_warnings(caplog, "cannot write the tuning cache")) == 1, caplog.text
    # Two kernels looked up under a directory that is no directory: one report, not one a key.
    assert len(_absl_warnings(caplog, "the cache directory is not a directory")) == 1, caplog.text
    assert "cache_unwritable" in autotune.format_cache() and "in memory" in autotune.format_cache()


SHIPPED, PARAMS = "sort_chunks", {}   # any kernel the library ships


def _shipped_copy_key():
    from te_jax_perm.autotune.__main__ import shipped_decls
    decl = shipped_decls()[SHIPPED]
    dims = {"N": 64, "H": 4096}
    return decl, cache.make_key(decl, dims, PARAMS, [np.float32, np.int32], "interpret"), dims


def test_print_cache_survives_any_file_and_names_the_bad_ones(tmp_cache):
    tmp_cache.mkdir(parents=True)
    files = {
        "a-non_utf8.json": b"\xff\xfe\x00",
        "b-null.json": b"null",
        "c-list.json": b"[]",
        "d-schema.json": json.dumps({"key": {"kernel": "x"}, "ranking": 5}).encode(),
        "e-noconfig.json": json.dumps({"key": {"kernel": "x"}, "ranking": [[{"constants": 1}, 0.1]]}).encode(),
        "f-kernel_list.json": json.dumps({"key": {"kernel": ["x"]}}).encode(),   # once crashed the listing
        "g-kernel_dict.json": json.dumps({"key": {"kernel": {"x": 1}}}).encode(),
    }
    for name, data in files.items():
        (tmp_cache / name).write_bytes(data)
    decl, key, dims = _shipped_copy_key()
    good = decl.default_config(dims, PARAMS).to_json()
    cache.store(key, {"best": good, "ranking": [[good, 1e-6]], "tuned_dims": dims})
    bad_key = dict(key, dims={**key["dims"], "N": 8192})
    cache.store(bad_key, {"best": None, "ranking": [[_cfg(BLOCK=3, BOGUS=1), 1e-6]], "tuned_dims": {**dims, "N": 8192}})
    # A valid entry under another key's file name: lookups ignore it, so the listing says so.
    moved_key = dict(key, dims={**key["dims"], "N": 128})
    moved = tmp_cache / cache.entry_path(moved_key).name
    moved.write_text(json.dumps({"key": key, "best": good, "ranking": [[good, 1e-6]], "tuned_dims": dims}))
    # The ranking edited, its best not: lookups read the ranking, the listing showed the best.
    edited_key = dict(key, dims={**key["dims"], "N": 256})
    other = decl.configs[1].to_json()
    cache.store(edited_key, {"best": good, "ranking": [[other, 1e-6], [good, 2e-6]], "tuned_dims": dims})
    out = subprocess.run([sys.executable, "-m", "te_jax_perm.autotune", "--print_cache", f"--cache_dir={tmp_cache}"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr[-3000:]
    bad_lines = [ln for ln in out.stdout.splitlines() if ln.startswith("BAD")]
    for name in files:
        assert any(name in ln for ln in bad_lines), out.stdout
    assert any(cache.entry_path(bad_key).name in ln and "BOGUS" in ln for ln in bad_lines), out.stdout
    assert sum(cache.entry_path(key).name in ln for ln in bad_lines) == 0, out.stdout
    assert f"{SHIPPED}  backend=interpret dims={dict(sorted(key['dims'].items()))}" in out.stdout, out.stdout
    assert any(moved.name in ln and "not the key this file name stands for" in ln for ln in bad_lines), out.stdout
    assert any(cache.entry_path(edited_key).name in ln and "not the first config of its ranking" in ln
               for ln in bad_lines), out.stdout
    assert cache.load(edited_key) is None
    assert "10 bad entries" in out.stdout, out.stdout


def test_format_cache_checks_configs_against_the_declaration(tmp_cache):
    decl, key, dims = _shipped_copy_key()
    cfg = decl.configs[0].to_json()
    wrong = dict(cfg, constants={**cfg["constants"], "BLOCK_H": 3})   # declared names and types, not a tile
    cache.store(key, {"best": wrong, "ranking": [[wrong, 1e-6]], "tuned_dims": dims})
    assert "BAD" not in cache.format_cache()                  # well formed...
    text = cache.format_cache({SHIPPED: decl})          # ...but not a config the kernel declares
    assert "BAD" in text and f"not one of {SHIPPED}'s declared configs" in text, text


def test_cli_help_exits_0_and_an_empty_cache_says_so(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = lambda *args: subprocess.run([sys.executable, "-m", "te_jax_perm.autotune", *args], capture_output=True,
                                       text=True, timeout=300, env=env)
    helped = run("--helpshort")
    assert helped.returncode == 0 and "--print_cache" in helped.stdout, helped.stderr[-2000:]
    empty = run("--print_cache", f"--cache_dir={tmp_path / 'none'}")
    assert empty.returncode == 0, empty.stderr[-2000:]
    assert "empty: nothing is tuned here yet" in empty.stdout, empty.stdout
    assert run("--no_such_flag").returncode == 1
    # A bad value fails by its flag's name, and a bad flag beside --help still fails.
    for args, said in ((("--dtype=int8",), "flag --dtype=int8: value should be one of"),
                       (("--max_candidates=-1",), "flag --max_candidates=-1: -1 is not a non-negative integer"),
                       (("--tune_shapes", "--small", "--shapes=nonexistent"),
                        "--shapes: shapes='nonexistent' matches none of the small shapes"),
                       (("extra",), "unexpected arguments ['extra']"),
                       (("--backend=xla", "--helpshort"), "flag --backend=xla: value should be one of")):
        failed = run(*args, f"--cache_dir={tmp_path / 'none'}")
        assert failed.returncode == 1 and said in failed.stdout + failed.stderr, (args, failed.stderr[-2000:])


def test_tune_ahead_names_what_it_takes():
    from tests.example_kernels import gather_rows
    pair = ([((16, 96), np.float32), ((5,), np.int32)], {})
    with pytest.raises(TypeError, match=r"tune_ahead: shapes_and_params\[0\] is \[\(\(16, 96\), <class "
                                        r"'numpy.float32'>\), \(\(5,\), <class 'numpy.int32'>\)\]; expected an "
                                        r"\(operand shapes, static params\) pair"):
        autotune.tune_ahead(gather_rows, [pair[0]], backend="interpret")
    with pytest.raises(ValueError, match=r"autotune: backend='xla' has no kernel configs to tune; expected one of"):
        autotune.tune_ahead(gather_rows, [pair], backend="xla")
    (result,) = autotune.tune_ahead(gather_rows, [pair], backend="INTERPRET")   # any case, as everywhere
    assert result.best is not None and result.key["backend"] == "interpret"


def test_every_tuning_entry_point_defaults_to_this_machines_kernels():
    # tune, tune_ahead and the command line tune the kernels this machine runs: the GPU's
    # own on a GPU, the interpreter elsewhere (the xla backend, a CPU's default, has none).
    from te_jax_perm.core.backends import default_platform
    from tests.example_kernels import gather_rows
    here = "triton" if default_platform() == "gpu" else "interpret"
    assert autotune.tuning_backend() == here and autotune.tuning_backend("Interpret") == "interpret"
    if here == "interpret":
        shapes = [((12, 40), np.float32), ((3,), np.int32)]
        assert autotune.tune(gather_rows, shapes, {}).key["backend"] == "interpret"
        (ahead,) = autotune.tune_ahead(gather_rows, [(shapes, {})])
        assert ahead.cached and ahead.key["backend"] == "interpret"


def test_tuning_the_gpu_kernels_away_from_the_gpu_is_refused_by_name(monkeypatch):
    # Trials place their buffers where JAX places computations: GPU kernels tuned under a
    # CPU default device would fail every config. On a CPU machine the GPU machine is stood
    # in for (triton available), under a CPU default device either way.
    from te_jax_perm.autotune import tuner
    from te_jax_perm.core import backends
    if backends.default_platform() != "gpu":
        monkeypatch.setattr(tuner, "resolve_backend", lambda name: backends.check_backend_name(name))
    with jax.default_device(jax.devices("cpu")[0]):
        with pytest.raises(ValueError, match=r"backend='triton' tunes GPU kernels.*'cpu'.*backend='interpret'"):
            autotune.tuning_backend("triton")
        assert autotune.tuning_backend() == "interpret"
    monkeypatch.setattr(tuner, "default_platform", lambda: "gpu")
    assert autotune.tuning_backend("triton") == "triton" and autotune.tuning_backend() == "triton"


def test_every_tuning_entry_point_takes_the_declared_op_or_its_declaration():
    from tests.example_kernels import gather_rows
    dims = {"N": 16, "H": 96, "R": 5}
    assert autotune.candidates(gather_rows, dims, {}) == autotune.candidates(gather_rows.decl, dims, {})
    shapes = [((16, 96), np.float32), ((5,), np.int32)]
    by_op = autotune.tune(gather_rows, shapes, {}, backend="interpret")
    by_decl = autotune.tune(gather_rows.decl, shapes, {}, backend="interpret")
    assert by_decl.cached and by_op.key == by_decl.key and by_op.best == by_decl.best
    for call in (lambda k: autotune.candidates(k, dims, {}), lambda k: autotune.tune(k, shapes, {}),
                 lambda k: autotune.tune_ahead(k, [(shapes, {})])):
        with pytest.raises(TypeError, match=r"kernel is function <function .*gather.*>; expected a declared kernel "
                                            r"\(what core.declare returns\) or its KernelDecl"):
            call(gather_rows.decl.kernel.fn)
