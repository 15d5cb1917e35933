"""The main example (examples/moe_permute.py) runs end to end and detects mismatches."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import pytest
from absl.testing import flagsaver

import te_jax_perm
from tests.conftest import KERNEL_BACKEND, ON_GPU

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "moe_permute.py"


@pytest.fixture(scope="module")
def example():
    # Loaded once: the module defines absl flags, which may be defined only once per process.
    name = "te_jax_perm_example_moe_permute"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


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


@pytest.mark.parametrize("backend,tokens,hidden,experts,topk,align,probs_in,dtype,ep", CASES)
def test_example_matches_dense_reference(example, backend, tokens, hidden, experts, topk, align, probs_in, dtype,
                                         ep):
    cfg = example.MoEConfig(tokens=tokens, hidden=hidden, ffn=2 * hidden, experts=experts, topk=topk,
                            dtype=dtype, align_size=align, backend=backend, probs_in=probs_in, ep_ranks=ep, steps=1)
    # Full-precision fp32 matmuls: GPUs default to TF32, whose ~1e-3 errors are not ours.
    with jax.default_matmul_precision("highest"):
        rep = example.run_example(cfg)
    assert rep.ok, rep.errors
    assert rep.backend == backend
    assert set(rep.errors) == {"output", "loss", "grad input", "grad router", "grad w_in", "grad w_out"}
    rows = (tokens // ep) * topk
    rows = (rows + experts * (align - 1)) // align * align if align else rows
    assert rep.shapes["output"] == (tokens, hidden)
    if ep == 1:
        assert rep.shapes["dispatched rows"] == (rows, hidden)
        assert rep.shapes["tokens_per_expert"] == (experts,)
    else:
        assert rep.shapes["rows per source rank"] == (ep, rows, hidden)
        assert rep.shapes["regrouped rows"] == (ep * rows, hidden)


def test_example_ep_detects_a_missing_regrouping(example, monkeypatch):
    """With EP, skipping the chunk sort (identity) must break the grouped GEMM and fail."""
    def identity_sort(inp, split_sizes, sorted_indices, *, backend=None):
        return inp, jax.numpy.arange(inp.shape[0], dtype=jax.numpy.int32)   # (output, row map)

    monkeypatch.setattr(te_jax_perm, "sort_chunks_by_index", identity_sort)
    cfg = example.MoEConfig(tokens=32, hidden=16, ffn=32, experts=4, topk=2, backend="xla", ep_ranks=2, steps=1)
    rep = example.run_example(cfg)
    assert not rep.ok
    assert rep.errors["output"] > rep.tolerance


def test_example_detects_a_broken_combine(example, monkeypatch):
    """A combine that ignores the merging probabilities must fail the check (and exit 1)."""
    real = te_jax_perm.token_combine

    def broken(inp, row_id_map, merging_probs=None, pad_offsets=None, *, backend=None):
        return real(inp, row_id_map, merging_probs=None, pad_offsets=pad_offsets, backend=backend)

    monkeypatch.setattr(te_jax_perm, "token_combine", broken)
    cfg = example.MoEConfig(tokens=32, hidden=16, ffn=32, experts=4, topk=2, backend="xla", steps=1)
    rep = example.run_example(cfg)
    assert not rep.ok
    assert rep.errors["output"] > rep.tolerance
    with flagsaver.flagsaver():
        example.FLAGS(["moe_permute", "--preset=cpu", "--tokens=32", "--hidden=16", "--experts=4", "--steps=1", "--backend=xla"])
        assert example.main([]) == 1


def test_example_cli_subprocess():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TE_JAX_PERM_BACKEND", None)
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--preset=cpu", "--tokens=24", "--hidden=16", "--experts=4",
                           "--align_size=4", "--steps=1"], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "PASS" in out and "max err grad router" in out and "dispatched rows" in out
    # the library's default on this platform
    assert f"te_jax_perm backend={'triton' if ON_GPU else 'xla'}" in out
    assert "step / GEMM limit" in out
    if not ON_GPU:
        assert "--backend=interpret" in out      # the CPU run points at the Triton kernels' interpreter
        assert "profile: GPU only" in out


def test_example_subset_check_catches_a_wrong_expert(example, monkeypatch):
    """At real sizes only a token subset is checked: the check must still see a broken GEMM
    (one expert's rows multiplied by the next expert's weights) in every gradient path."""
    real = te_jax_perm.grouped_matmul

    def shifted(lhs, rhs, group_sizes, **kw):
        return real(lhs, jax.numpy.roll(rhs, 1, axis=0), group_sizes, **kw)

    cfg = example.MoEConfig(tokens=96, hidden=16, ffn=16, experts=12, topk=2, backend="xla", steps=1,
                            check_tokens=24)
    rep = example.run_example(cfg)
    assert rep.ok and rep.checked_tokens == 24 and len(rep.checked_experts) == 4, rep
    monkeypatch.setattr(te_jax_perm, "grouped_matmul", shifted)
    rep = example.run_example(cfg)
    assert not rep.ok
    assert rep.errors["output"] > rep.tolerance and rep.errors["grad w_in"] > rep.tolerance


def test_example_helpshort_explains_every_flag():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--helpshort"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)
    text = proc.stdout + proc.stderr
    flags_part = text[text.index("flags:"):]
    import re
    names = re.findall(r"^  --(?:\[no\])?(\w+):(.*)$", flags_part, re.M)
    assert {n for n, _ in names} >= {"preset", "tokens", "hidden", "ffn", "experts", "topk", "dtype", "backend",
                                    "gemm", "align_size", "probs_in", "ep_ranks", "steps", "check_tokens",
                                    "profile", "json_out", "seed"}
    assert all(len(h.strip()) > 10 for _, h in names), names
