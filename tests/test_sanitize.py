"""The hazard sanitizer on planted-bug kernels: each hazard class is reported precisely,
and the fixed twins (and atomics) are reported clean."""
import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax_perm
from te_jax_perm.core import Config, declare
from te_jax_perm.core.hooks import BufferInfo
from te_jax_perm.core.interpret_backend import HostPointer, launch_interpreted
from te_jax_perm.sanitize import (IN_PLACE, OOB, READ_WRITE, UNWRITTEN, WRITE_WRITE, Hazard, HazardError, check,
                                  sanitize)
from tests import planted_kernels as pk

# The interpret backend runs on host buffers: on a GPU machine too, these run on the CPU.
pytestmark = pytest.mark.usefixtures("on_cpu")

INTERP = "interpret"


def _info(name, role, a):
    return BufferInfo(name, role, a.ctypes.data, a.nbytes, a.dtype, tuple(a.shape))


def test_public_name_is_the_package():
    assert te_jax_perm.sanitize.sanitize is sanitize


# -- out of bounds ----------------------------------------------------------------------
@pytest.mark.parametrize("H", [5, 16, 70])
def test_off_by_one_mask_is_out_of_bounds(H):
    N, idx = 6, [5, 0, 2, 2, 5]
    src = jnp.arange(N * H, dtype=jnp.float32).reshape(N, H)
    r = check(lambda: pk.gather_off_by_one(src, jnp.array(idx, jnp.int32), backend=INTERP))
    oob = r.of_kind(OOB)
    # Loads overrun `src` only in programs gathering its last row; the store overruns
    # `out` only in the last program.
    want = {(("src", (p, 0, 0), "load", (N * H, N * H + 1))) for p, s in enumerate(idx) if s == N - 1}
    want.add(("out", (len(idx) - 1, 0, 0), "store", (len(idx) * H, len(idx) * H + 1)))
    assert {(h.buffer, h.programs[0], h.access, h.elements) for h in oob} == want, r.text()
    assert all(h.kernel == "planted_gather_off_by_one" and h.count == 1 for h in oob)
    assert {h.buffer_elements for h in oob if h.buffer == "src"} == {N * H}
    # The extra lane of each row also lands on the next row's first element.
    ww = r.of_kind(WRITE_WRITE)
    assert {(h.programs, h.elements) for h in ww} == {
        (((p, 0, 0), (p + 1, 0, 0)), ((p + 1) * H, (p + 1) * H + 1)) for p in range(len(idx) - 1)}
    assert "out-of-bounds store by program (4, 0, 0) on 'out'" in r.text()


@pytest.mark.parametrize("H", [1, 5, 70])
@pytest.mark.parametrize("block", [16, 128])
def test_masked_lanes_are_not_accesses(H, block):
    src = jnp.arange(4 * H, dtype=jnp.bfloat16).reshape(4, H)
    idx = jnp.array([3, 0, 3], jnp.int32)
    r = check(lambda: pk.gather_ok(src, idx, backend=INTERP, config=Config.make(
        BLOCK_H=block)))
    assert not r, r.text()
    (launch,) = r.launches
    assert launch.bytes_stored["out"] == 3 * H * 2
    assert launch.bytes_loaded["src"] == 2 * H * 2  # rows 0 and 3, each read in full


def test_overrun_into_a_neighbouring_buffer_is_charged_to_its_source():
    # `src` and `out` are adjacent in one allocation: src's overrun lands inside `out`.
    N, H, idx = 3, 4, np.array([2, 1], np.int32)
    arena = np.zeros(N * H + len(idx) * H, np.float32)
    src, out = arena[:N * H].reshape(N, H), arena[N * H:].reshape(len(idx), H)
    src[:] = np.arange(N * H).reshape(N, H)
    bufs = [_info("src", "input", src), _info("idx", "input", idx), _info("out", "output", out)]
    args = {"src_ptr": HostPointer(src), "idx_ptr": HostPointer(idx), "H": H,
            "out_prealloc_ptr": HostPointer(out), "out_ptr": HostPointer(out)}
    with sanitize() as r:
        launch_interpreted(pk.gather_rows_kernel, (len(idx), 1, 1), args, {"BLOCK_H": 8, "OFF_BY_ONE": True},
                           name="adjacent", buffers=bufs)
    assert ("src", (0, 0, 0), "load", (N * H, N * H + 1)) in {
        (h.buffer, h.programs[0], h.access, h.elements) for h in r.of_kind(OOB)}, r.text()
    assert not [h for h in r.hazards if h.buffer == "out" and h.access == "load"], r.text()


@pytest.mark.parametrize("over", [3, 8])
@pytest.mark.parametrize("access", ["load", "store"])
@pytest.mark.parametrize("form", range(len(pk.POINTER_FORMS)), ids=pk.POINTER_FORMS)
def test_tensor_offset_overrun_into_a_neighbour_is_charged_to_its_base_pointer(form, access, over):
    # The overrunning buffer comes first in one allocation, its neighbour right after, so
    # every overrunning lane lands inside the neighbour. Program 1 covers elements [8, 16):
    # all past the end of the 8-element buffers.
    N = 8
    arena = np.zeros(2 * N, np.int32)
    src, out = (arena[:N], arena[N:]) if access == "load" else (arena[N:], arena[:N])
    src[:] = np.arange(1, N + 1)
    bufs = [_info("src", "input", src), _info("out", "output", out)]
    args = {"src_ptr": HostPointer(src), "N": N, "out_prealloc_ptr": HostPointer(out), "out_ptr": HostPointer(out)}
    constexprs = {"BLOCK": 8, "FORM": form, "LOAD_OVER": over if access == "load" else 0,
                  "STORE_OVER": over if access == "store" else 0}
    with sanitize() as r:
        launch_interpreted(pk.overrun_copy_kernel, (2, 1, 1), args, constexprs, name="adjacent_overrun", buffers=bufs)
    got = [(h.kind, h.buffer, h.programs, h.access, h.elements, h.count) for h in r.hazards]
    want = ("src" if access == "load" else "out")
    assert got == [(OOB, want, ((1, 0, 0),), access, (N, N + over), over)], r.text()
    # The overrunning lanes were suppressed: the copy is exact and the neighbour untouched.
    np.testing.assert_array_equal(out, np.arange(1, N + 1))
    np.testing.assert_array_equal(src, np.arange(1, N + 1))


@pytest.mark.parametrize("N", [8, 13, 5, 21, 16])
def test_out_of_bounds_store_is_charged_to_the_same_buffer_every_run(N):
    # Through the declared primitive, wherever XLA places the buffers.
    over = 3
    prim = pk.overrun_copy(0, over, name=f"planted_overrun_store_{N}")
    src = jnp.arange(1, N + 1, dtype=jnp.int32)
    for _ in range(3):
        r = check(lambda: prim(src, backend=INTERP))
        assert {(h.kind, h.buffer, h.access) for h in r.hazards} == {(OOB, "out", "store")}, r.text()
        hit = set().union(*(range(*h.elements) for h in r.hazards))
        assert hit == set(range(N, N + over)), r.text()


def test_raise_on_first_stops_at_the_first_hazard():
    src = jnp.ones((3, 5), jnp.float32)
    with pytest.raises(HazardError) as e:
        with sanitize(raise_on_first=True):
            jax.block_until_ready(pk.gather_off_by_one(src, jnp.array([2], jnp.int32), backend=INTERP))
    h = e.value.hazard
    assert (h.kind, h.buffer, h.programs, h.elements) == (OOB, "src", ((0, 0, 0),), (15, 16))


def test_out_of_bounds_lanes_are_suppressed_not_performed():
    x = jnp.zeros((2, 5), jnp.float32)
    # Under the sanitizer the bad lane is masked off, so the output equals the reference
    # (and no host memory past the buffer is touched).
    with sanitize() as r:
        out = jax.block_until_ready(pk.gather_off_by_one(x + 1, jnp.array([1, 0], jnp.int32), backend=INTERP))
    assert r.of_kind(OOB)
    np.testing.assert_array_equal(out[0], np.ones((2, 5), np.float32))


# -- write-write overlap (lesson 2) -------------------------------------------------------
def test_tiled_writer_with_rows_per_program_below_tile_overlaps():
    T, H, NS, BT = 10, 3, 5, 4   # BS = cdiv(10, 5) = 2 < BT = 4
    unchecked = declare(dataclasses.replace(pk.tiled_scale.decl, name="planted_tiled_unchecked", constraints=()))
    cfg = Config.make(NS=NS, BT=BT)
    assert pk.tiled_scale.decl.violated({"T": T, "H": H}, {}, cfg)
    x = jnp.arange(T * H, dtype=jnp.float32).reshape(T, H)
    r = check(lambda: unchecked(x, backend=INTERP, config=cfg))
    ww = r.of_kind(WRITE_WRITE)
    assert ww and {h.kind for h in r.hazards} == {WRITE_WRITE}, r.text()
    # Program p writes rows [2p, 2p+4): neighbours share rows 2p+2, 2p+3; p and p+2 none.
    got = {(h.programs, h.elements, h.count) for h in ww}
    want = {(((p, 0, 0), (p + 1, 0, 0)), ((2 * p + 2) * H, min(2 * p + 4, T) * H), (min(2 * p + 4, T) - 2 * p - 2) * H)
            for p in range(NS - 1)}
    assert got == want, r.text()


@pytest.mark.parametrize("T", [1, 7, 10])
def test_every_unpruned_tiled_config_is_clean_and_every_overlap_and_gap_is_pruned(T):
    decl = pk.tiled_scale.decl
    unchecked = declare(dataclasses.replace(decl, name=f"planted_tiled_unchecked_{T}", constraints=()))
    x = jnp.arange(T * 3, dtype=jnp.float32).reshape(T, 3)
    for cfg in decl.configs:
        r = check(lambda: unchecked(x, backend=INTERP, config=cfg))
        if r.of_kind(WRITE_WRITE):
            assert decl.violated({"T": T, "H": 3}, {}, cfg), f"{cfg} races at T={T} but is not pruned"
        if r.of_kind(UNWRITTEN):
            assert decl.violated({"T": T, "H": 3}, {}, cfg), f"{cfg} leaves rows unwritten at T={T} but is not pruned"
        if not decl.violated({"T": T, "H": 3}, {}, cfg):
            assert not r, r.text()


def test_output_elements_no_program_stores_are_reported_unless_the_output_starts_as_zeros():
    """Memory nobody wrote: at T = 7 with two programs of one row each (rows per program 4),
    rows 0 and 4 are stored and the other five rows are returned as allocated."""
    decl = pk.tiled_scale.decl
    gappy = declare(dataclasses.replace(decl, name="planted_tiled_gappy", constraints=()))
    x = jnp.arange(7 * 3, dtype=jnp.float32).reshape(7, 3)
    cfg = Config.make(NS=2, BT=1)
    r = check(lambda: gappy(x, backend=INTERP, config=cfg))
    (h,) = r.hazards
    assert (h.kind, h.buffer, h.programs, h.elements, h.count, h.buffer_elements) == (
        UNWRITTEN, "out", (), (3, 21), 15, 21)
    assert h.text() == ("kernel 'planted_tiled_gappy': no program stores 15 element(s) in element offsets [3, 21) "
                        "of output 'out' (21 elements), which does not start as zeros: they are returned as allocated")
    with pytest.raises(HazardError, match="no program stores 15 element"):
        check(lambda: gappy(x, backend=INTERP, config=cfg), raise_on_first=True)
    zeroed = declare(dataclasses.replace(decl, name="planted_tiled_gappy_zeroed", constraints=(),
                                         outputs=(dataclasses.replace(decl.outputs[0], init="zeros"),)))
    assert not check(lambda: zeroed(x, backend=INTERP, config=cfg)), "zeros are written by the allocation"


# -- cross-program read/write, and in-place safety (lesson 1) ----------------------------
def test_row_permutation_is_clean_as_passed_but_not_in_place_safe():
    T, H = 5, 3
    dst = np.array([1, 2, 3, 4, 0], np.int32)
    x = jnp.arange(T * H, dtype=jnp.float32).reshape(T, H)
    r = check(lambda: pk.scatter_rows(x, jnp.asarray(dst), backend=INTERP))
    assert not r and r.in_place, r.text()   # a verdict on hypothetical aliasing, not a bug
    assert {h.kind for h in r.in_place} == {IN_PLACE}
    assert r.in_place_unsafe("planted_scatter_rows") == {("x", "out")}
    # Program r loads row r of x; program q with dst[q] == r stores it.
    got = {(h.input, h.buffer, h.programs, h.elements) for h in r.in_place}
    want = {("x", "out", ((row, 0, 0), (int(np.flatnonzero(dst == row)[0]), 0, 0)), (row * H, row * H + H))
            for row in range(T)}
    assert got == want
    assert "is not in-place safe for (input 'x', output 'out')" in r.text()
    assert "is not in-place safe for (input 'x', output 'out'): program (0, 0, 0) loads 'x' where program (4, 0, 0)" \
        in r.in_place[0].text()


def test_identity_permutation_is_in_place_safe():
    x = jnp.ones((4, 3), jnp.float32)
    r = check(lambda: pk.scatter_rows(x, jnp.arange(4, dtype=jnp.int32), backend=INTERP))
    assert not r and not r.in_place, r.text()
    (launch,) = r.launches
    assert launch.in_place_checked == (("x", "out"),) and launch.in_place_unsafe == ()


def test_row_permutation_run_with_input_aliased_to_output():
    # Really share the memory, as XLA did in lesson 1: x and out are one buffer.
    T, H = 4, 3
    buf = np.arange(T * H, dtype=np.float32).reshape(T, H)
    dst = np.array([3, 0, 1, 2], np.int32)
    bufs = [_info("x", "input", buf), _info("dst", "input", dst), _info("out.prealloc", "prealloc", buf),
            _info("out", "output", buf)]
    args = {"x_ptr": HostPointer(buf), "dst_ptr": HostPointer(dst), "H": H,
            "out_prealloc_ptr": HostPointer(buf), "out_ptr": HostPointer(buf)}
    with sanitize() as r:
        launch_interpreted(pk.scatter_rows_kernel, (T, 1, 1), args, {"BLOCK_H": 4}, name="aliased_scatter",
                           buffers=bufs)
    rw = r.of_kind(READ_WRITE)
    assert {(h.buffer, h.programs) for h in rw} == {
        ("out", ((q, 0, 0), (int(np.flatnonzero(dst == q)[0]), 0, 0))) for q in range(T)}, r.text()


# -- atomics -----------------------------------------------------------------------------
def test_atomic_accumulator_is_not_an_overlap():
    v = jnp.array([0, 1, 2, 3, 1, 1, 2, 0, 0, 3, 3, 2, 2], jnp.int32)
    with sanitize() as r:
        out = jax.block_until_ready(pk.bin_count_atomic(v, num_bins=4, backend=INTERP))
    assert not r, r.text()
    np.testing.assert_array_equal(out[0], np.bincount(np.asarray(v), minlength=4))
    assert r.launches[0].bytes_atomic["counts"] == 16 and r.launches[0].bytes_stored["counts"] == 0


def test_non_atomic_accumulator_is_reported():
    v = jnp.array([0, 1, 2, 3, 1, 1, 2, 0, 0, 3, 3], jnp.int32)   # 2 programs of 8
    r = check(lambda: pk.bin_count_racy(v, num_bins=4, backend=INTERP))
    assert {(h.kind, h.programs) for h in r.hazards} == {
        (WRITE_WRITE, ((0, 0, 0), (1, 0, 0))), (READ_WRITE, ((0, 0, 0), (1, 0, 0))),
        (READ_WRITE, ((1, 0, 0), (0, 0, 0)))}, r.text()
    assert all(h.buffer == "counts" and h.elements == (0, 4) for h in r.hazards)


# -- modes -------------------------------------------------------------------------------
def test_nested_sessions_both_see_the_launch_and_none_after_exit():
    src = jnp.ones((3, 5), jnp.float32)
    idx = jnp.array([2], jnp.int32)
    with sanitize() as outer:
        with sanitize() as inner:
            jax.block_until_ready(pk.gather_off_by_one(src, idx, backend=INTERP))
    assert outer.hazards == inner.hazards and outer.of_kind(OOB)
    # Outside any session nothing is recorded (and the interpreter is unpatched).
    with sanitize() as later:
        pass
    jax.block_until_ready(pk.gather_off_by_one(src, idx, backend=INTERP))
    assert not later.launches


def test_hazard_is_structured():
    h = Hazard(OOB, "k", "out", ((3, 0, 0),), "store", (10, 11), 1, 10)
    assert dataclasses.asdict(h)["programs"] == ((3, 0, 0),)
    assert "program (3, 0, 0)" in h.text() and "'out'" in h.text()


@pytest.mark.parametrize("mode", ["raise", "collect"])
def test_environment_variable_enables_the_sanitizer(mode):
    code = (
        "import jax, jax.numpy as jnp\n"
        "from tests import planted_kernels as pk\n"
        "import te_jax_perm.sanitize as s\n"
        "try:\n"
        "    jax.block_until_ready(pk.gather_off_by_one(jnp.ones((3, 5)), jnp.array([2], jnp.int32),"
        " backend='interpret'))\n"
        "except Exception as e:\n"
        "    print('RAISED', type(e).__name__, 'out-of-bounds load by program (0, 0, 0)' in str(e))\n"
        "r = s.env_report()\n"
        "print('OOB', len(r.of_kind(s.OOB)))\n")
    env = {**os.environ, "TE_JAX_PERM_SANITIZE": mode, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if mode == "raise":
        assert "RAISED HazardError True" in out.stdout, out.stdout + out.stderr
    else:
        assert "RAISED" not in out.stdout and "OOB 2" in out.stdout, out.stdout + out.stderr


def test_hazard_raised_under_jit_is_given_back_by_hazard_error():
    """Under TE_JAX_PERM_SANITIZE=raise, a hazard raised inside a jitted function arrives as
    XLA's runtime error, its message ending with the hazard's text; hazard_error returns
    the HazardError itself, for an out-of-bounds access (raised at the access) and for an
    overlap (raised when the launch ends)."""
    code = (
        "import jax, jax.numpy as jnp\n"
        "from tests import planted_kernels as pk\n"
        "import te_jax_perm.sanitize as s\n"
        "runs = [lambda: pk.gather_off_by_one(jnp.ones((3, 5)), jnp.array([2], jnp.int32), backend='interpret'),\n"
        "        lambda: pk.scatter_rows(jnp.ones((2, 3)), jnp.array([1, 1], jnp.int32), backend='interpret')]\n"
        "for run in runs:\n"
        "    try:\n"
        "        jax.block_until_ready(jax.jit(run)())\n"
        "    except Exception as e:\n"
        "        h = s.hazard_error(e)\n"
        "        print('RAISED', type(e).__name__, type(h).__name__, h.hazard.kind,\n"
        "              str(e).rstrip().endswith('HazardError: ' + str(h)), repr(str(h)))\n"
        "print('OTHER', s.hazard_error(RuntimeError('unrelated')))\n")
    env = {**os.environ, "TE_JAX_PERM_SANITIZE": "raise", "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("RAISED", "OTHER"))]
    assert len(lines) == 3, out.stdout + out.stderr
    assert lines[0].startswith("RAISED JaxRuntimeError HazardError out_of_bounds True "
                               "\"kernel 'planted_gather_off_by_one': out-of-bounds load by program (0, 0, 0) "
                               "on 'src'"), lines[0]
    assert lines[1].startswith("RAISED JaxRuntimeError HazardError write_write True "
                               "\"kernel 'planted_scatter_rows': programs (0, 0, 0) and (1, 0, 0) both store "
                               "to 'out'"), lines[1]
    assert lines[2] == "OTHER None"


# -- on a machine whose default device is a GPU ---------------------------------------------
def test_sanitizer_scope_places_computations_on_the_cpu():
    with jax.default_device(None), sanitize():
        assert jax.config.jax_default_device == jax.devices("cpu")[0]


def test_eager_interpret_call_is_lowered_on_the_cpu_when_the_default_backend_is_not(monkeypatch):
    """Simulates a GPU machine: with JAX's default backend not the CPU, an eager interpret
    call is lowered (and run) under the CPU device, not wherever the default device is."""
    from te_jax_perm.core import hooks
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    seen = []
    src = jnp.arange(7 * 3, dtype=jnp.float32).reshape(7, 3)   # a shape no other test lowers
    with jax.default_device(None), hooks.observe_calls(lambda call: seen.append(jax.config.jax_default_device)):
        (out,) = pk.gather_ok(src, jnp.array([6, 0], jnp.int32), backend=INTERP)
    assert seen and seen[-1] == jax.devices("cpu")[0]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(src)[[6, 0]])


def test_alias_audit_of_the_xla_backend_says_there_was_nothing_to_audit():
    f = lambda x: te_jax_perm.sort_chunks_by_index(x, jnp.array([2, 2]), jnp.array([1, 0]), backend="xla")[0]
    report = te_jax_perm.audit_aliases(f, jnp.ones((4, 3)))
    assert not report.audited and not report.ok
    assert str(report).startswith("nothing to audit: no te_jax_perm custom call"), str(report)
    g = lambda x: te_jax_perm.sort_chunks_by_index(x, jnp.array([2, 2]), jnp.array([1, 0]), backend=INTERP)[0]
    report = te_jax_perm.audit_aliases(g, jnp.ones((4, 3)))
    assert report.audited and report.ok, str(report)


def test_unique_is_numpys_unique_by_one_sort():
    """The tracer's distinct-values helper gives ``np.unique``'s answer (sorted, distinct),
    empty and int64 keys past 2**32 included."""
    from te_jax_perm.sanitize.tracer import unique
    rng = np.random.default_rng(0)
    for a in (np.zeros(0, np.int64), np.array([5], np.int64), rng.integers(0, 50, 1000),
              rng.integers(-2**40, 2**40, 10_000), np.repeat(np.arange(7, dtype=np.int64), 3)[::-1]):
        got = unique(a)
        np.testing.assert_array_equal(got, np.unique(a))
        assert got.dtype == a.dtype
