"""The ``triton`` backend's custom call, checked without a GPU: a CUDA lowering of a real
kernel (compiled by Triton for sm_90) with a stand-in for jaxlib's kernel-call bindings,
so the target, the API version, the aliases and the kernel-call parameters are the ones a
GPU run executes. The compatibility table is checked against the ``[cuda]`` extra's pins."""
import json
import pathlib
import re
import tomllib
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from te_jax_perm.core import compat, triton_backend
from tests.example_kernels import gather_rows, histogram

ROOT = pathlib.Path(__file__).resolve().parent.parent


class FakeKernelCallLib:
    """Stands in for ``jax._src.lib.gpu_triton``: records what the backend builds, and
    serializes it as JSON where jaxlib writes its protobuf."""

    def __init__(self, ffi_registered=True):
        self.kernels = []
        targets = {triton_backend.FFI_TARGET: {}} if ffi_registered else {}
        self._cuda_triton = types.SimpleNamespace(registrations=lambda: targets)

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


def _lower_for_cuda(fn, *args, mode="ffi", lib=None):
    lib = lib or FakeKernelCallLib()
    jax.clear_caches()  # the call mode is read when lowering; JAX caches lowerings
    with triton_backend.kernel_call_library(lib, 90), triton_backend.triton_call_mode(mode):
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


def test_legacy_lowering_is_the_same_call_on_the_old_target():
    src, idx = jnp.ones((7, 33), jnp.float32), jnp.zeros((5,), jnp.int32)
    lowered, _ = _lower_for_cuda(_gather, src, idx, mode="legacy")
    (call,) = [c for c in _custom_calls(lowered) if "AllocateBuffer" not in str(c.attributes["call_target_name"])]
    assert str(call.attributes["call_target_name"]) == f'"{triton_backend.LEGACY_TARGET}"'
    assert "2" in str(call.attributes["api_version"]) and "mhlo.backend_config" not in call.attributes
    assert _aliases(call) == [(2, 0)]


def test_default_mode_follows_what_jaxlib_registers():
    assert triton_backend.current_mode(FakeKernelCallLib(ffi_registered=True)) == "ffi"
    assert triton_backend.current_mode(FakeKernelCallLib(ffi_registered=False)) == "legacy"
    src, idx = jnp.ones((3, 8), jnp.float32), jnp.zeros((2,), jnp.int32)
    lib = FakeKernelCallLib(ffi_registered=False)
    with triton_backend.kernel_call_library(lib, 90), triton_backend.triton_call_mode("ffi"):
        with pytest.raises(Exception, match="does not register triton_kernel_call_ffi|typed-FFI"):
            jax.jit(_gather).trace(src, idx).lower(lowering_platforms=("cuda",))


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
    from te_jax_perm.core import triton_compile
    src, idx = jnp.ones((9, 40), jnp.float32), jnp.zeros((4,), jnp.int32)
    _lower_for_cuda(_gather, src, idx)
    before = triton_compile._compile_cached.cache_info().misses
    lowered, lib = _lower_for_cuda(_gather, jnp.ones((11, 40), jnp.float32), jnp.zeros((6,), jnp.int32))
    assert triton_compile._compile_cached.cache_info().misses == before  # same binary: H is a runtime scalar


# -- the [cuda] extra against the compatibility table -----------------------------------------
def _extra(name):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["optional-dependencies"][name]]


@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_cuda_extra_pins_a_working_set(python):
    reqs = [r for r in _extra("cuda") if r.marker is None or r.marker.evaluate({"python_version": python})]
    by_name = {r.name: r for r in reqs}
    # No jax-triton: the default call modes do not need it (and 0.3.x cannot bound its triton).
    assert "jax-triton" not in by_name
    jax_req, triton_req = by_name["jax"], by_name["triton"]
    assert "cuda13" in jax_req.extras or "cuda12" in jax_req.extras
    # Every jax the extra admits registers the typed-FFI call...
    assert all(v >= compat.FFI_MIN_JAXLIB for v in map(Version, ["0.10.1", "0.11.2"]) if v in jax_req.specifier)
    assert Version("0.10.0") not in jax_req.specifier
    # ... and every triton it admits is one the backend was run with on a GPU.
    for v in ["3.6.0", "3.6.5", "3.7.0", "3.9.0", "3.5.0"]:
        assert (Version(v) in triton_req.specifier) == (Version(v) in compat.TRITON_TESTED_SPEC), v


def test_jax_triton_extra_is_a_pair_of_the_table():
    by_name = {r.name: r for r in _extra("jax-triton")}
    (pinned,) = [Version(str(by_name["jax-triton"].specifier).lstrip("="))]
    (pair,) = [p for p in compat.JAX_TRITON_PAIRS if pinned in p.jax_triton]
    for v in ["3.5.0", "3.6.0", "3.6.9", "3.7.0", "3.9.0"]:
        assert (Version(v) in by_name["triton"].specifier) == (Version(v) in pair.triton), v


def test_jax_triton_pairs_name_the_fix(monkeypatch):
    versions = {"jax-triton": "0.3.1", "triton": "3.9.0", "jax": "0.11.2", "jaxlib": "0.11.2"}
    monkeypatch.setattr(compat, "installed", lambda p: Version(versions[p]) if p in versions else None)
    (problem,) = compat.problems("jax_triton")
    assert "jax-triton 0.3.1 does not work with triton 3.9.0" in problem and "pip install 'triton<3.7,>=3.6'" in problem
    versions["triton"] = "3.6.0"
    assert compat.problems("jax_triton") == []
    versions.update({"jax-triton": "0.4.0", "triton": "3.6.0"})
    assert "needs triton>=3.7" in compat.problems("jax_triton")[0]
    versions["jaxlib"] = "0.10.0"
    assert any("no typed-FFI Triton call" in p for p in compat.problems("ffi"))
    del versions["triton"]
    assert any("the triton package is not installed" in p for p in compat.problems("legacy"))
