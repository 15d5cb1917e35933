"""The main example (examples/moe_permute.py) runs end to end and detects mismatches."""
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest
from absl.testing import flagsaver

import te_jax_perm
from examples import moe_permute as example
from tests.conftest import KERNEL_BACKEND, ON_GPU
from tests.multidevice import without_cpu_devices

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "moe_permute.py"
ERRORS = {"loss", "output", "grad input", "grad router", "grad w_in", "grad w_out"}

KERNEL = KERNEL_BACKEND  # the real kernel on this machine: interpret on CPU, triton on GPU
CASES = [  # backend, tokens, hidden, experts, topk, align_size, probs_in, dtype, ep_ranks
    ("xla", 64, 32, 4, 2, None, "combine", "float32", 1),
    ("xla", 37, 24, 6, 3, 8, "dispatch", "bfloat16", 1),
    ("xla", 1, 16, 4, 1, 4, "combine", "float32", 1),
    ("xla", 48, 24, 6, 3, 8, "dispatch", "bfloat16", 3),   # EP: chunk sort regrouping
    (KERNEL, 16, 16, 4, 2, None, "combine", "float32", 1),
    (KERNEL, 13, 16, 4, 2, 4, "dispatch", "float32", 1),
    (KERNEL, 16, 16, 4, 2, 4, "combine", "float32", 2),
]


def _ok(errors, dtype="float32"):
    return all(e <= example.TOLERANCE[dtype] for e in errors.values())


@pytest.mark.parametrize("backend,tokens,hidden,experts,topk,align,probs_in,dtype,ep", CASES)
def test_example_matches_dense_reference(backend, tokens, hidden, experts, topk, align, probs_in, dtype, ep):
    cfg = example.MoEConfig(tokens=tokens, hidden=hidden, ffn=2 * hidden, experts=experts, topk=topk, dtype=dtype,
                  align_size=align, backend=backend, probs_in=probs_in, ep_ranks=ep)
    # Full-precision fp32 matmuls: GPUs default to TF32, whose ~1e-3 errors are not ours.
    with jax.default_matmul_precision("highest"):
        errors = example.check(cfg)
    assert set(errors) == ERRORS
    assert _ok(errors, dtype), errors


def test_example_ep_detects_a_missing_regrouping(monkeypatch):
    """With EP, skipping the chunk sort (identity) must break the grouped GEMM and fail."""
    def identity_sort(inp, split_sizes, sorted_indices, *, backend=None):
        return inp, jax.numpy.arange(inp.shape[0], dtype=jax.numpy.int32)   # (output, row map)

    monkeypatch.setattr(te_jax_perm, "sort_chunks_by_index", identity_sort)
    errors = example.check(example.MoEConfig(tokens=32, hidden=16, ffn=32, experts=4, topk=2, backend="xla", ep_ranks=2))
    assert errors["output"] > example.TOLERANCE["float32"]


def test_example_detects_a_broken_combine(monkeypatch):
    """A combine that ignores the merging probabilities must fail the check (and exit 1)."""
    real = te_jax_perm.token_combine

    def broken(inp, row_id_map, merging_probs=None, pad_offsets=None, *, backend=None):
        return real(inp, row_id_map, merging_probs=None, pad_offsets=pad_offsets, backend=backend)

    monkeypatch.setattr(te_jax_perm, "token_combine", broken)
    errors = example.check(example.MoEConfig(tokens=32, hidden=16, ffn=32, experts=4, topk=2, backend="xla"))
    assert errors["output"] > example.TOLERANCE["float32"]
    with flagsaver.flagsaver():
        example.flags.FLAGS(["moe_permute", "--tokens=32", "--hidden=16", "--experts=4", "--backend=xla"])
        assert example.main([]) == 1


def test_example_catches_a_wrong_expert(monkeypatch):
    """One expert's rows multiplied by the next expert's weights: every gradient path sees it."""
    real = te_jax_perm.grouped_matmul

    def shifted(lhs, rhs, group_sizes, **kw):
        return real(lhs, jax.numpy.roll(rhs, 1, axis=0), group_sizes, **kw)

    cfg = example.MoEConfig(tokens=96, hidden=16, ffn=16, experts=12, topk=2, backend="xla")
    assert _ok(example.check(cfg))
    monkeypatch.setattr(te_jax_perm, "grouped_matmul", shifted)
    errors = example.check(cfg)
    tol = example.TOLERANCE["float32"]
    assert errors["output"] > tol and errors["grad w_in"] > tol and errors["grad input"] > tol


def _run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TE_JAX_PERM_BACKEND", None)
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def test_example_cli_subprocess():
    proc = _run("--tokens=24", "--hidden=16", "--experts=4", "--align_size=4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.rstrip().endswith("PASS") and "max error grad router" in out
    assert f"te_jax_perm backend {'triton' if ON_GPU else 'xla'}" in out   # the library's default here


def test_example_helpshort_explains_every_flag_and_exits_0():
    proc = _run("--helpshort")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    names = re.findall(r"^  --(?:\[no\])?(\w+):(.*)$", text[text.index("flags:"):], re.M)
    assert {n for n, _ in names} == {"tokens", "hidden", "ffn", "experts", "topk", "dtype", "backend", "gemm",
                                     "align_size", "probs_in", "ep_ranks", "seed"}
    assert all(len(h.strip()) > 10 for _, h in names), names


FSDP_EXAMPLE = ROOT / "examples" / "moe_fsdp.py"


def test_fsdp_example_reduce_scatters_the_weight_gradients_and_matches_one_device():
    """The data x FSDP example on 8 virtual CPU devices (2 x 4): one step equals the step on
    one device, the weights come back split, and the step's module reduce-scatters the weight
    gradients (an all-reduce of whole gradients would show no reduce-scatter)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               XLA_FLAGS=without_cpu_devices(), JAX_PLATFORMS="cpu")
    env.pop("TE_JAX_PERM_BACKEND", None)
    proc = subprocess.run([sys.executable, str(FSDP_EXAMPLE), "--cpu_devices=8", "--data=2", "--steps=1"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "mesh data=2 x fsdp=4" in out and out.rstrip().endswith("vs one device") and "\nPASS" in out, out
    assert re.search(r"reduce-scatter x2\b", out), out
