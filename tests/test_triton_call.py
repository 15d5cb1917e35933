"""The ``triton`` backend's custom call, checked without a GPU: a CUDA lowering of a real
kernel (compiled by Triton for sm_90) with a stand-in for jaxlib's kernel-call bindings,
so the target, the API version, the aliases and the kernel-call parameters are the ones a
GPU run executes. The version table is checked against the ``[cuda]`` extra's pins."""
import json
import os
import pathlib
import re
import tomllib
import types
import zlib

import jax
import jax.numpy as jnp
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from te_jax_perm.core import triton_backend
from tests.example_kernels import gather_rows, histogram

ROOT = pathlib.Path(__file__).resolve().parent.parent


class FakeKernelCallLib:
    """Stands in for ``jax._src.lib.gpu_triton``: records what the backend builds, and
    serializes it as JSON where jaxlib writes its protobuf."""

    def __init__(self, ffi_registered=True):
        self.kernels = []
        targets = {triton_backend.FFI_TARGET: {}} if ffi_registered else {}
        self._cuda_triton = types.SimpleNamespace(registrations=lambda: targets)

    def get_compute_capability(self, device):
        return 90                                   # an H100

    def TritonKernel(self, *args):
        self.kernels.append(args)
        return {"name": args[0], "num_warps": args[1], "num_ctas": args[2], "shared": args[3],
                "ptx_entry": "entry " + args[0] in args[4].replace(".entry ", "entry "), "cc": args[6],
                "extra": list(args[7:])}

    def create_array_parameter(self, bytes_to_zero, divisibility):
        return {"array": [bytes_to_zero, divisibility]}

    def create_scalar_parameter(self, value, dtype):
        return {"scalar": [value, dtype]}

    def TritonKernelCall(self, kernel, gx, gy, gz, params):
        return types.SimpleNamespace(to_proto=lambda name, metadata: json.dumps(
            {"name": name, "kernel": kernel, "grid": [gx, gy, gz], "params": params}).encode())


def _custom_calls(lowered):
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if child.operation.name == "stablehlo.custom_call":
                        calls.append(child.operation)
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    return calls


def _lower_for_cuda(fn, *args, lib=None):
    lib = lib or FakeKernelCallLib()
    jax.clear_caches()  # the kernel-call library is read when lowering; JAX caches lowerings
    # Lowered with ``lib`` standing in for jaxlib's CUDA bindings: the exact custom calls a
    # GPU run would execute, without a GPU.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_backend, "kernel_call_lib", lambda: lib)
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)), lib


def _aliases(op):
    return [(int(re.search(r"operand_index = (\d+)", str(a)).group(1)),
             int((re.search(r"output_tuple_indices = \[(\d*)\]", str(a)).group(1) or 0)))
            for a in op.attributes["output_operand_aliases"]]


def _gather(src, idx):
    # bind the primitive directly: there is no GPU to resolve backend "triton" here
    return gather_rows.prim.bind(src, idx, backend="triton", config=None)[0]


def test_ffi_lowering_target_aliases_and_kernel_call():
    src, idx = jnp.ones((7, 33), jnp.float32), jnp.zeros((5,), jnp.int32)
    lowered, lib = _lower_for_cuda(_gather, src, idx)
    calls = [c for c in _custom_calls(lowered) if str(c.attributes["call_target_name"]).strip('"') != "AllocateBuffer"]
    (call,) = calls
    assert str(call.attributes["call_target_name"]) == f'"{triton_backend.FFI_TARGET}"'
    # JAX writes a typed-FFI call (API version 4) as a dictionary of attributes in
    # mhlo.backend_config (with the StableHLO api_version 1 that carries it).
    assert "mhlo.backend_config" in call.attributes and str(call.attributes["backend_config"]) == '""'
    # operands: src, idx, then the preallocated output, aliased to result 0
    assert len(call.operands) == 3 and _aliases(call) == [(2, 0)]
    opaque = call.attributes["mhlo.backend_config"]["opaque"]
    payload = json.loads(zlib.decompress(opaque.value_bytes if hasattr(opaque, "value_bytes") else
                                         str(opaque).strip('"').encode("latin1")))
    assert payload["name"] == "te_jax_perm.example_gather_rows"
    assert payload["grid"] == [5, 1, 1]
    # kernel order: src_ptr, idx_ptr, H, out_prealloc_ptr, out_ptr
    assert payload["params"] == [{"array": [0, 16]}, {"array": [0, 16]}, {"scalar": [33, "i32"]},
                                 {"array": [0, 16]}, {"array": [0, 16]}]
    kernel = payload["kernel"]
    assert kernel["name"] == "gather_rows_kernel" and kernel["cc"] == 90 and kernel["ptx_entry"]
    assert kernel["num_warps"] == gather_rows.decl.default_config({"H": 33}, {}).num_warps
    assert kernel["extra"] == []  # no global scratch: the 7-argument TritonKernel of every jaxlib


def test_a_jaxlib_without_the_ffi_call_is_refused_by_name():
    src, idx = jnp.ones((3, 8), jnp.float32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(Exception, match="does not register triton_kernel_call_ffi"):
        _lower_for_cuda(_gather, src, idx, lib=FakeKernelCallLib(ffi_registered=False))


def _gather_spec(h):
    """The compile of ``gather_rows`` over ``[7, h]`` rows, as the triton backend makes it."""
    from te_jax_perm.core.launch import bind_call, configure
    call = bind_call(gather_rows.decl, [jnp.ones((7, h), jnp.float32), jnp.zeros((5,), jnp.int32)], {}, "triton")
    return triton_backend.launch_spec(configure(call, gather_rows.decl.default_config(call.dims, call.params)))


def test_integer_scalars_are_specialised_like_tritons_launcher():
    """Divisible by 16: a divisibility attribute (vectorised accesses); 1: a constant that
    the call no longer passes; anything else: a plain runtime value."""
    def spec(h):
        spec = _gather_spec(h)
        return dict(spec.signature), dict(spec.constexprs), spec.attrs

    sig, constexprs, attrs = spec(32)  # parameters: src_ptr, idx_ptr, H, out_prealloc, out
    assert sig["H"] == "i32" and (2,) in attrs and "H" not in constexprs
    sig, constexprs, attrs = spec(33)
    assert sig["H"] == "i32" and (2,) not in attrs and set(attrs) == {(0,), (1,), (3,), (4,)}
    sig, constexprs, attrs = spec(1)
    assert sig["H"] == "constexpr" and constexprs["H"] == 1
    lowered, lib = _lower_for_cuda(_gather, jnp.ones((7, 1), jnp.float32), jnp.zeros((5,), jnp.int32))
    (call,) = [c for c in _custom_calls(lowered) if triton_backend.FFI_TARGET in str(c.attributes["call_target_name"])]
    opaque = call.attributes["mhlo.backend_config"]["opaque"]
    payload = json.loads(zlib.decompress(opaque.value_bytes if hasattr(opaque, "value_bytes") else
                                         str(opaque).strip('"').encode("latin1")))
    assert payload["params"] == [{"array": [0, 16]}] * 4  # H=1 is compiled in, not passed


def test_zeroed_output_and_every_alias_in_a_differentiated_step():
    """Zeroed outputs arrive zeroed as their preallocated operand (no bytes_to_zero), and
    every kernel of a vmapped program keeps its alias."""
    values = jnp.arange(10, dtype=jnp.int32)
    lowered, lib = _lower_for_cuda(lambda v: histogram.prim.bind(v, backend="triton", config=None, num_bins=4)[0],
                                   values)
    (call,) = [c for c in _custom_calls(lowered) if triton_backend.FFI_TARGET in str(c.attributes["call_target_name"])]
    assert _aliases(call) == [(1, 0)] and len(call.operands) == 2
    src, idx = jnp.ones((2, 6, 16), jnp.float32), jnp.zeros((2, 3), jnp.int32)
    lowered, _ = _lower_for_cuda(jax.vmap(_gather), src, idx)
    ours = [c for c in _custom_calls(lowered) if triton_backend.FFI_TARGET in str(c.attributes["call_target_name"])]
    assert ours and all(_aliases(c) == [(2, 0)] for c in ours)


def test_kernels_are_compiled_once_per_specialisation():
    from te_jax_perm.core import triton_backend
    src, idx = jnp.ones((9, 40), jnp.float32), jnp.zeros((4,), jnp.int32)
    _lower_for_cuda(_gather, src, idx)
    before = triton_backend.compile_cached.cache_info().misses
    lowered, lib = _lower_for_cuda(_gather, jnp.ones((11, 40), jnp.float32), jnp.zeros((6,), jnp.int32))
    assert triton_backend.compile_cached.cache_info().misses == before  # same binary: H is a runtime scalar


def _payload(call):
    opaque = call.attributes["mhlo.backend_config"]["opaque"]
    return json.loads(zlib.decompress(opaque.value_bytes if hasattr(opaque, "value_bytes") else
                                      str(opaque).strip('"').encode("latin1")))


def test_a_kernel_with_global_scratch_gets_a_workspace_xla_allocates():
    """A TMA grouped GEMM builds tensor descriptors on the device, in global scratch. The
    call brings that memory as one more result (programs x per-program bytes, never
    returned), passed where Triton's kernel expects its scratch pointer, with a null
    profile pointer after it; jaxlib is never asked to allocate it (its stream allocation
    cannot live in a command buffer)."""
    import numpy as np

    from te_jax_perm.core import hooks
    from te_jax_perm.ops.grouped_gemm import decl as D

    m, c, d, g = 512, 128, 256, 4
    dims, params = {"M": m, "C": c, "D": d, "G": g}, {"elem_bytes": 2, "out_dtype": "bfloat16"}
    cfg = next(c for c in D.TMA_CONFIGS if not D.grouped_gemm.decl.violated(dims, params, c))
    lhs, rhs = jnp.ones((m, c), jnp.bfloat16), jnp.ones((g, c, d), jnp.bfloat16)
    sizes = jnp.asarray([100, 0, 300, 50], jnp.int32)
    with hooks.using_config_resolver(lambda call: cfg if call.decl.name == D.grouped_gemm.decl.name else None):
        lowered, lib = _lower_for_cuda(
            lambda a, b, s: D.grouped_gemm.prim.bind(a, b, s, backend="triton", config=None, **params)[0], lhs, rhs,
            sizes)
    (call,) = [c for c in _custom_calls(lowered) if triton_backend.FFI_TARGET in str(c.attributes["call_target_name"])]
    payload = _payload(call)
    (kernel,) = [k for k in lib.kernels if k[0] == payload["kernel"]["name"]]
    assert payload["kernel"]["extra"] == [] and len(kernel) == 7
    programs = payload["grid"][0] * payload["grid"][1] * payload["grid"][2]
    # results: the output, then the workspace (uint8, programs x per-program scratch)
    results = [str(t) for t in call.results.types]
    assert len(results) == 2 and results[0] == f"tensor<{m}x{d}xbf16>"
    size = int(re.fullmatch(r"tensor<(\d+)xui8>", results[1]).group(1))
    assert size > 0 and size % programs == 0 and size // programs >= 3 * 128  # 3 descriptors of 128 bytes
    # parameters: lhs, rhs, group sizes, M, out_prealloc, out, then workspace and null profile
    assert payload["params"][-2:] == [{"array": [0, 128]}, {"scalar": [0, "u64"]}]
    assert len(payload["params"]) == 8
    # ... and the traced function returns only the output
    assert lowered.out_info.shape == (m, d) and lowered.out_info.dtype == np.dtype(jnp.bfloat16)


def test_a_call_whose_parameters_differ_from_the_compiled_entry_is_refused():
    kernel = triton_backend.CompiledKernel("k", 4, 1, 0, ".entry k(\n.param .u64 k_param_0,\n.param .u64 k_param_1\n)",
                                           90, 0, 1)
    triton_backend.check_parameter_count(kernel, 2)
    with pytest.raises(RuntimeError, match="takes 2 parameters; the call passes 3"):
        triton_backend.check_parameter_count(kernel, 3)


# -- the [cuda] extra against the compatibility table -----------------------------------------
def _extra(name):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["optional-dependencies"][name]]


@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_cuda_extra_pins_a_working_set(python):
    reqs = [r for r in _extra("cuda") if r.marker is None or r.marker.evaluate({"python_version": python})]
    by_name = {r.name: r for r in reqs}
    assert "jax-triton" not in by_name  # the typed-FFI call needs none
    jax_req, triton_req = by_name["jax"], by_name["triton"]
    assert "cuda13" in jax_req.extras or "cuda12" in jax_req.extras
    # Every jax the extra admits registers the typed-FFI call...
    assert all(v >= triton_backend.FFI_MIN_JAXLIB for v in map(Version, ["0.10.1", "0.11.2"]) if v in jax_req.specifier)
    assert Version("0.10.0") not in jax_req.specifier
    # ... and every triton it admits is one the backend was run with on a GPU.
    for v in ["3.6.0", "3.6.5", "3.7.0", "3.9.0", "3.5.0"]:
        assert (Version(v) in triton_req.specifier) == (Version(v) in triton_backend.TRITON_TESTED_SPEC), v


def test_problems_name_the_fix(monkeypatch):
    versions = {"triton": "3.6.0", "jax": "0.11.2", "jaxlib": "0.11.2"}
    monkeypatch.setattr(triton_backend, "installed", lambda p: Version(versions[p]) if p in versions else None)
    assert triton_backend.problems() == []
    versions["jaxlib"] = "0.10.0"
    assert any("jaxlib 0.10.0" in p and "pip install" in p for p in triton_backend.problems())
    del versions["triton"]
    assert any("the triton package is not installed" in p for p in triton_backend.problems())


def test_kernels_compile_without_line_info_unless_the_user_asks(monkeypatch, tmp_path):
    """Line info more than doubles the PTX each call's payload carries (and XLA's Triton call
    reads the payload on every execution); a user's own TRITON_DISABLE_LINE_INFO=0 keeps it."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_DISABLE_LINE_INFO", raising=False)
    spec = _gather_spec(64)
    bare = spec.compile(("cuda", 90, 32)).asm["ptx"]
    assert ".loc" not in bare and ".file" not in bare
    assert "TRITON_DISABLE_LINE_INFO" not in os.environ  # the compile left no trace
    monkeypatch.setenv("TRITON_DISABLE_LINE_INFO", "0")
    with_lines = spec.compile(("cuda", 90, 32)).asm["ptx"]
    assert ".loc" in with_lines and len(with_lines) > 2 * len(bare)


def test_compiles_parse_kernel_sources_under_the_source_lock(monkeypatch, tmp_path):
    """CPython 3.11's parser fails when threads parse at once, and lowerings in several
    threads compile at once: the compile cache's first hash of a kernel and Triton's code
    generator parse kernel sources, so they parse under the lock the interpreter's launches
    and the tuning key's hash parse under."""
    import threading

    from triton.runtime.jit import JITFunction

    from te_jax_perm.core.env import source_lock
    from te_jax_perm.core.launch import bind_call, configure

    def held_here():
        # Held by this thread exactly when another thread cannot take it (nothing else runs).
        took = []

        def probe():
            took.append(source_lock.acquire(blocking=False))
            if took[0]:
                source_lock.release()
        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return not took[0]

    held, parse = [], JITFunction.parse
    monkeypatch.setattr(JITFunction, "parse", lambda self: held.append(held_here()) or parse(self))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))   # a compile, not a hit in Triton's cache
    triton_backend.compile_cached.cache_clear()                # nor in ours
    call = bind_call(gather_rows.decl, [jnp.ones((7, 40), jnp.float32), jnp.zeros((5,), jnp.int32)], {}, "triton")
    triton_backend.compiled_for(configure(call, gather_rows.decl.default_config(call.dims, call.params)), 90)
    assert held and all(held), held
