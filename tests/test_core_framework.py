"""The framework promise, tested on the worked example kernels."""
import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.buffer_callback import buffer_callback

import te_jax_perm
from te_jax_perm.core import BackendUnavailableError, Config
from tests.conftest import KERNEL_BACKEND, ON_GPU
from tests.example_kernels import gather_rows, histogram


def _inputs(n, h, r, dtype, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.standard_normal((n, h)).astype(np.float32)
    return jnp.asarray(src, dtype), jnp.asarray(rng.integers(0, n, size=r), jnp.int32)


DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn]


@pytest.mark.parametrize("n,h,r", [(1, 1, 1), (7, 33, 5), (16, 64, 16), (5, 130, 9)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gather_bit_exact_every_backend(backend, n, h, r, dtype):
    src, idx = _inputs(n, h, r, dtype)
    (out,) = jax.jit(lambda s, i: gather_rows(s, i, backend=backend))(src, idx)
    expected = np.asarray(src)[np.asarray(idx)]
    assert out.dtype == src.dtype and out.shape == (r, h)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), expected.view(np.uint8))


def test_every_config_gives_same_bits(kernel_backend):
    src, idx = _inputs(9, 70, 6, jnp.bfloat16)
    expected = np.asarray(src)[np.asarray(idx)]
    for cfg in gather_rows.decl.configs:
        (out,) = jax.jit(lambda s, i: gather_rows(s, i, backend=kernel_backend, config=cfg))(src, idx)
        np.testing.assert_array_equal(np.asarray(out), expected, err_msg=str(cfg))


def test_vmap_equals_python_loop(backend):
    src, idx = _inputs(6, 40, 4, jnp.float32)
    srcs = jnp.stack([src, src * 2, src - 1])
    idxs = jnp.stack([idx, idx[::-1], jnp.zeros_like(idx)])
    f = lambda s, i: gather_rows(s, i, backend=backend)[0]
    batched = jax.jit(jax.vmap(f))(srcs, idxs)
    looped = jnp.stack([f(s, i) for s, i in zip(srcs, idxs)])
    np.testing.assert_array_equal(np.asarray(batched), np.asarray(looped))
    # Only some operands batched: the unbatched source is shared by every iteration.
    shared = jax.jit(jax.vmap(f, in_axes=(None, 0)))(src, idxs)
    np.testing.assert_array_equal(np.asarray(shared), np.stack([np.asarray(src)[np.asarray(i)] for i in idxs]))
    # Batch axis not leading.
    moved = jax.jit(jax.vmap(f, in_axes=(2, 1), out_axes=1))(jnp.moveaxis(srcs, 0, 2), idxs.T)
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(jnp.moveaxis(looped, 0, 1)))


def test_donated_inputs_give_identical_results(backend):
    src, idx = _inputs(12, 48, 12, jnp.float32)
    expected = np.asarray(src)[np.asarray(idx)]

    def step(s, i):
        (g,) = gather_rows(s, i, backend=backend)
        # Same shape as `s`: XLA may reuse the donated buffer for the result; only the
        # declared alias keeps it from handing the kernel's input memory to its output.
        return g, s + 1

    f = jax.jit(step, donate_argnums=(0,))
    out, bumped = f(jnp.array(src), idx)
    np.testing.assert_array_equal(np.asarray(out), expected)
    np.testing.assert_array_equal(np.asarray(bumped), np.asarray(src) + 1)


def test_zero_initialised_accumulator(backend):
    values = jnp.asarray(np.random.default_rng(1).integers(-2, 12, size=300), jnp.int32)
    (counts,) = jax.jit(lambda v: histogram(v, num_bins=10, backend=backend))(values)
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(np.clip(np.asarray(values), -1, 10) + 1,
                                                                   minlength=12)[1:11])


def test_empty_grid_is_not_launched(backend):
    src, _ = _inputs(4, 8, 1, jnp.float32)
    (out,) = gather_rows(src, jnp.zeros((0,), jnp.int32), backend=backend)
    assert out.shape == (0, 8)


# -- alias audit -------------------------------------------------------------------------

def test_audit_finds_declared_alias_for_every_output(kernel_backend):
    src, idx = _inputs(5, 16, 3, jnp.float32)
    values = jnp.arange(10, dtype=jnp.int32)

    def f(s, i, v):
        return gather_rows(s, i, backend=kernel_backend)[0], histogram(v, num_bins=4, backend=kernel_backend)[0]

    report = te_jax_perm.audit_aliases(f, src, idx, values)
    assert {c.kernel for c in report.ours} == {"example_gather_rows", "example_histogram"}, str(report)
    assert report.ok, str(report)
    for call in report.ours:
        assert call.aliases == {0: len(call.operand_types) - 1}, str(report)


def test_audit_covers_vmapped_and_differentiated_code(kernel_backend):
    src, idx = _inputs(5, 16, 3, jnp.float32)
    f = jax.vmap(lambda s, i: gather_rows(s, i, backend=kernel_backend)[0])
    report = te_jax_perm.audit_aliases(f, jnp.stack([src, src]), jnp.stack([idx, idx]))
    assert len(report.ours) == 1 and report.ok, str(report)


def test_audit_flags_handwritten_call_without_alias():
    x = jnp.ones((4, 4), jnp.float32)

    def handwritten(a):
        with jax.named_scope("te_jax_perm.handwritten_unaliased"):
            return buffer_callback(lambda ctx, out, inp: None, jax.ShapeDtypeStruct(a.shape, a.dtype))(a)

    report = te_jax_perm.audit_aliases(handwritten, x)
    (call,) = report.ours
    assert call.kernel == "handwritten_unaliased"
    assert call.unaliased_results == (0,)
    assert not report.ok
    assert "UNALIASED" in str(report)


def test_audit_ignores_xla_backend_and_reports_no_calls():
    src, idx = _inputs(5, 16, 3, jnp.float32)
    report = te_jax_perm.audit_aliases(lambda s, i: gather_rows(s, i, backend="xla"), src, idx)
    assert report.ours == ()


# -- trace-time errors -------------------------------------------------------------------

def test_wrong_rank_names_argument_and_shape():
    src, idx = _inputs(5, 16, 3, jnp.float32)
    with pytest.raises(ValueError, match=r"argument 'idx' has shape \(3, 1\).*expected rank 1 with axes \(R\)"):
        gather_rows(src, idx[:, None], backend="xla")


def test_wrong_dtype_names_argument():
    src, idx = _inputs(5, 16, 3, jnp.float32)
    with pytest.raises(TypeError, match=r"argument 'idx' has dtype float32; expected one of \['int32'\]"):
        gather_rows(src, idx.astype(jnp.float32), backend="xla")


def test_operands_that_are_options_or_too_many_name_the_kernel():
    """A backend name given positionally, a None, or one array too many: the kernel's own
    error naming the operands (a string used to fail inside JAX's array conversion)."""
    src, idx = _inputs(5, 16, 3, jnp.float32)
    for args, message in [((src, idx, "xla"), r"^example_gather_rows: positional argument 2 is 'xla'; expected an array "
                                              r"\(the operands are src, idx; pass backend, config and params by "
                                              r"keyword\)"),
                          ((src, "xla"), r"^example_gather_rows: argument 'idx' is 'xla'; expected an array"),
                          ((src, None), r"^example_gather_rows: argument 'idx' is None; expected an array"),
                          ((src, idx, idx), r"^example_gather_rows: expected 2 operands \(src, idx\), got 3"),
                          ((src,), r"^example_gather_rows: expected 2 operands \(src, idx\), got 1")]:
        with pytest.raises(TypeError, match=message):
            gather_rows(*args, backend="xla")


def test_mismatched_dims_name_both_arguments():
    values = jnp.arange(4, dtype=jnp.int32)
    from te_jax_perm.core import KernelDecl, Operand, Output, declare
    pair = declare(KernelDecl(
        name="pair_check", kernel=None,
        operands=(Operand("inp", ("T", "H")), Operand("routing_map", ("T", "E"))),
        outputs=(Output("o", lambda d, p: (d["T"],), lambda t, p: jnp.float32),),
        reference=lambda a, b: (a[:, 0],), grid=lambda d, p, c: (1,),
        default_config=lambda d, p: Config.make()))
    with pytest.raises(ValueError, match=r"argument 'routing_map' has shape \(3, 2\); expected \(T=4, E\) "
                                         r"\(axis T=4 from 'inp'\)"):
        pair(jnp.ones((4, 8)), jnp.ones((3, 2)), backend="xla")
    del values


def test_a_reference_that_breaks_its_declaration_names_kernel_and_output():
    """A bare array instead of a tuple, or an output of another dtype than the declaration's,
    fails naming the kernel and the output, not as a shape mismatch deep in the lowering."""
    import dataclasses
    from te_jax_perm.core import declare
    src, idx = _inputs(5, 16, 3, jnp.bfloat16)
    bare = declare(dataclasses.replace(gather_rows.decl, name="bare_reference",
                                       reference=lambda src, idx: src[idx]))
    with pytest.raises(TypeError, match=r"bare_reference: its reference returned a single array; "
                                        r"expected a tuple of 1 array\(s\), one per output \['out'\]"):
        bare(src, idx, backend="xla")
    widened = declare(dataclasses.replace(gather_rows.decl, name="widened_reference",
                                          reference=lambda src, idx: (src[idx].astype(jnp.float32),)))
    with pytest.raises(TypeError, match=r"widened_reference: its reference's output 'out' is "
                                        r"float32\[3, 16\]; the declaration makes it bfloat16\[3, 16\]"):
        jax.jit(lambda s, i: widened(s, i, backend="xla"))(src, idx)


def test_non_static_param_is_rejected_at_trace_time():
    values = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(TypeError, match=r"parameter 'num_bins' must be a static Python value"):
        jax.jit(lambda v, n: histogram(v, num_bins=n, backend="xla"))(values, 3)
    with pytest.raises(ValueError, match=r"num_bins must be a positive int, got 0"):
        histogram(values, num_bins=0, backend="xla")


def test_invalid_explicit_config_is_rejected():
    from te_jax_perm.core import KernelDecl
    assert isinstance(gather_rows.decl, KernelDecl)
    src, idx = _inputs(5, 16, 3, jnp.float32)
    with pytest.raises(Exception, match="BLOCK_H"):
        jax.jit(lambda s, i: gather_rows(s, i, backend=KERNEL_BACKEND, config=Config.make()))(src, idx)


# -- backend selection -------------------------------------------------------------------

def test_use_backend_context_and_keyword_precedence():
    src, idx = _inputs(5, 16, 3, jnp.float32)
    with te_jax_perm.use_backend(KERNEL_BACKEND):
        assert len(te_jax_perm.audit_aliases(lambda s, i: gather_rows(s, i), src, idx).ours) == 1
        # The keyword wins over the context.
        assert te_jax_perm.audit_aliases(lambda s, i: gather_rows(s, i, backend="xla"), src, idx).ours == ()
    with pytest.raises(ValueError, match=r"^unknown backend='cuda'; expected one of \('triton', 'interpret', 'xla'\)$"):
        with te_jax_perm.use_backend("cuda"):
            pass
    with pytest.raises(ValueError, match=r"^unknown backend='cuda'; expected one of "):
        gather_rows(src, idx, backend="cuda")


def test_jit_traces_again_for_another_use_backend_block(on_cpu):
    # One jitted function called in blocks naming different backends runs each block's:
    # jit's cache keys on the block, so the second block traces it again.
    from tests.launches import recorded_launches
    src, idx = _inputs(5, 16, 3, jnp.float32)
    traces = []
    f = jax.jit(lambda s, i: (traces.append(te_jax_perm.resolve_backend()), gather_rows(s, i))[1])
    ran = []
    with recorded_launches() as launches:
        for name in ("xla", "interpret", "xla", "interpret"):
            with te_jax_perm.use_backend(name) as chosen:
                assert chosen == name
                before = len(launches)
                (out,) = f(src, idx)
                jax.block_until_ready(out)
                ran.append((name, len(launches) - before))
            np.testing.assert_array_equal(np.asarray(out), np.asarray(src)[np.asarray(idx)])
    assert traces == ["xla", "interpret"], f"traced for {traces}; expected once per backend, the later calls cached"
    assert ran == [("xla", 0), ("interpret", 1), ("xla", 0), ("interpret", 1)], \
        f"(block, kernels launched) per call: {ran}; the interpreter must run exactly under use_backend('interpret')"


def test_env_var_sets_default_backend_in_fresh_process():
    code = ("import jax.numpy as jnp, te_jax_perm\n"
            "from tests.example_kernels import gather_rows\n"
            "r = te_jax_perm.audit_aliases(lambda s, i: gather_rows(s, i), jnp.ones((3, 4)), jnp.zeros((2,), jnp.int32))\n"
            "print('OURS', len(r.ours))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TE_JAX_PERM_BACKEND=KERNEL_BACKEND, PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert "OURS 1" in out.stdout, out.stderr


@pytest.mark.skipif(ON_GPU, reason="checks the error raised where no GPU exists")
def test_triton_backend_unavailable_gives_one_clear_error():
    src, idx = _inputs(5, 16, 3, jnp.float32)
    with pytest.raises(BackendUnavailableError, match=r"needs a CUDA GPU.*backend 'interpret'"):
        gather_rows(src, idx, backend="triton")


def test_default_backend_on_this_platform():
    from te_jax_perm.core.backends import default_backend
    assert default_backend() == ("triton" if ON_GPU else "xla")


def test_default_backend_follows_jaxs_default_device(monkeypatch):
    # On a GPU machine, computations placed on the CPU by jax.default_device take the CPU's
    # defaults: the xla backend for the ops and the interpreter for tuning (the GPU's kernels
    # cannot run there). A GPU machine is stood in for by JAX's default backend.
    from te_jax_perm import autotune
    from te_jax_perm.core.backends import default_backend, default_platform
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert (default_platform(), default_backend()) == ("gpu", "triton")
    for device in (jax.devices("cpu")[0], "cpu"):
        with jax.default_device(device):
            assert (default_platform(), default_backend()) == ("cpu", "xla")
            assert autotune.tuning_backend() == "interpret"
            assert te_jax_perm.resolve_backend() == "xla"


# -- preallocated buffers ------------------------------------------------------------------

def test_empty_outputs_are_poisoned_on_cpu_so_unwritten_elements_show():
    if ON_GPU:
        pytest.skip("GPU buffers are uninitialised, not poisoned")
    from te_jax_perm.core.aliasing import uninitialized
    vals = jax.jit(lambda: (uninitialized((3,), jnp.float32), uninitialized((2,), jnp.int32),
                            uninitialized((2,), jnp.bfloat16)))()
    assert np.isnan(np.asarray(vals[0])).all()
    np.testing.assert_array_equal(np.asarray(vals[1]), [-1, -1])
    assert np.isnan(np.asarray(vals[2], np.float32)).all()


@pytest.mark.gpu
def test_empty_outputs_cost_no_memset_on_gpu():
    src, idx = _inputs(64, 256, 64, jnp.bfloat16)
    f = jax.jit(lambda s, i: gather_rows(s, i, backend="triton")[0])
    hlo = f.lower(src, idx).compile().as_text()
    # The only work in the program is our kernel: no fusion filling the output first.
    assert "fusion" not in hlo and "broadcast" not in hlo, hlo
    np.testing.assert_array_equal(np.asarray(f(src, idx)), np.asarray(src)[np.asarray(idx)])


def test_kernel_signature_is_checked_by_name_not_count(kernel_backend):
    """A scalar moved to a constexpr on one side only keeps the count but shifts every
    later argument by one; the launch must refuse rather than pass a pointer as a size."""
    import dataclasses
    from te_jax_perm.core import declare
    shifted = declare(dataclasses.replace(
        gather_rows.decl, name="example_gather_rows_shifted", scalars=lambda d, p: {},
        constexprs=lambda d, p, c: {"H": d["H"]}))
    src, idx = _inputs(5, 16, 3, jnp.float32)
    with pytest.raises(TypeError, match=r"does not match its declaration: 2 operand pointers, scalars \[\]") as e:
        jax.jit(lambda s, i: shifted(s, i, backend=kernel_backend))(src, idx)
    # The order the convention expects, spelled out (this declaration passes no scalar).
    assert "expected the parameters (src_ptr, idx_ptr, out_prealloc_ptr, out_ptr, BLOCK_H, H)" in str(e.value)


def test_pointers_named_after_another_buffer_are_refused(kernel_backend):
    """Two outputs' pointers listed as (a_prealloc, a, b_prealloc, b): the count matches, but
    the convention passes every preallocated pointer first, so ``a_ptr`` would receive
    ``b``'s preallocated buffer. The names give it away before anything runs."""
    from tests.planted_kernels import interleaved_outputs
    with pytest.raises(TypeError, match=r"parameter 3 'a_ptr', the name of output 'a', where the calling convention "
                                        r"passes output 'b''s preallocated buffer; expected the parameters in the "
                                        r"order \(src_ptr, N, a_prealloc_ptr, b_prealloc_ptr, a_ptr, b_ptr\)"):
        jax.jit(lambda s: interleaved_outputs(s, backend=kernel_backend))(jnp.zeros((8,), jnp.float32))


def test_an_eager_interpret_error_points_at_the_kernels_line(on_cpu):
    """A kernel failing inside the interpreter raises its own error, and its traceback
    reaches the kernel's failing line (the launch runs in XLA's host callback, whose error
    XLA hands on only as text)."""
    import traceback

    from tests.planted_kernels import broken_store
    with pytest.raises(ValueError, match="incompatible dimensions") as info:
        broken_store(jnp.zeros((8,), jnp.float32), backend="interpret")
    frames = traceback.extract_tb(info.value.__traceback__)
    assert any(f.name == "broken_store_kernel" and "2 * BLOCK" in (f.line or "") for f in frames), frames


# -- launch checks ---------------------------------------------------------------------------

def test_params_check_sees_each_params_type_even_after_an_equal_value():
    values = jnp.arange(6, dtype=jnp.int32)
    histogram(values, num_bins=2, backend="xla")
    # 2.0 == 2 and hashes alike: a cache keyed on values alone would skip the check.
    with pytest.raises(ValueError, match=r"num_bins must be a positive int, got 2\.0"):
        histogram(values, num_bins=2.0, backend="xla")


def test_params_check_sees_the_types_inside_a_tuple_param():
    def ints(d, p):
        if not all(type(g) is int for g in p["grid"]):
            raise ValueError(f"grid must hold ints, got {p['grid']!r}")
    op = te_jax_perm.core.declare(dataclasses.replace(_grid_decl("test_core_tuple_param", "empty").decl,
                                                      name="test_core_tuple_param_checked", params_check=ints))
    src, idx = _inputs(4, 8, 2, jnp.float32)
    op(src, idx, grid=(2,), backend="xla")
    # (2.0,) == (2,) and hashes alike, as do (True,) and (1,).
    with pytest.raises(ValueError, match=r"grid must hold ints, got \(2\.0,\)"):
        op(src, idx, grid=(2.0,), backend="xla")
    op(src, idx, grid=(1,), backend="xla")
    with pytest.raises(ValueError, match=r"grid must hold ints, got \(True,\)"):
        op(src, idx, grid=(True,), backend="xla")


def _grid_decl(name, init):
    from tests.example_kernels import gather_rows_kernel
    return te_jax_perm.core.declare(te_jax_perm.core.KernelDecl(
        name=name, kernel=gather_rows_kernel,
        operands=(te_jax_perm.core.Operand("src", ("N", "H")), te_jax_perm.core.Operand("idx", ("R",), ("int32",))),
        outputs=(te_jax_perm.core.Output("out", lambda d, p: (d["R"], d["H"]), lambda t, p: t["src"], init=init),),
        params=("grid",), reference=lambda src, idx, grid: (src[idx],), grid=lambda d, p, c: p["grid"],
        scalars=lambda d, p: {"H": d["H"]}, default_config=lambda d, p: Config.make(BLOCK_H=16)))


@pytest.mark.parametrize("grid", [(), (1, 1, 1, 1), (2, -1), 5])
def test_a_grid_triton_cannot_launch_is_refused_naming_it(kernel_backend, grid):
    src, idx = _inputs(4, 8, 2, jnp.float32)
    op = _grid_decl("test_core_bad_grid", "empty")
    with pytest.raises(ValueError, match=r"test_core_bad_grid: its grid .* is " + repr(grid).replace("(", r"\(")
                       .replace(")", r"\)") + r"; expected one to three program counts, none negative"):
        op(src, idx, grid=grid, backend=kernel_backend)


def test_an_empty_grid_that_would_leave_an_output_unwritten_is_refused(kernel_backend):
    src, idx = _inputs(4, 8, 2, jnp.float32)
    with pytest.raises(ValueError, match=r"runs no program, but output 'out' has shape \(2, 8\) and does not start as "
                                         "zeros: nothing would write it"):
        _grid_decl("test_core_empty_grid", "empty")(src, idx, grid=(0,), backend=kernel_backend)
    # Zero-initialised outputs are written by their allocation: the launch is skipped.
    (out,) = _grid_decl("test_core_empty_grid_zeros", "zeros")(src, idx, grid=(2, 0), backend=kernel_backend)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((2, 8), np.float32))
