"""Kernel declaration of the fused MoE layer's first expert GEMM (:mod:`te_jax_perm.kernels.moe_ffn`),
which reads token rows through the row owners (``moe_gather_gemm``). The rest of the layer,
forward and backward, runs the grouped GEMM's and the permutation's own kernels
(:mod:`te_jax_perm.ops.moe_ffn.api`).

It tiles as the grouped GEMM does (its tile schedule, tuning space, shared-memory rule and
default configs); its reference is :mod:`te_jax_perm.ops.moe_ffn.reference`'s, the public op
and its VJP :mod:`te_jax_perm.ops.moe_ffn.api`.
"""
from __future__ import annotations

import numpy as np

from te_jax_perm.core import KernelDecl, Operand, Output, declare
from te_jax_perm.kernels import moe_ffn as K
from te_jax_perm.ops.grouped_gemm.decl import (FLOATS, GEMM_SHARED, MM_CONFIGS, groups_p2, mm_default, mm_fits,
                                               mm_grid, precision)
from te_jax_perm.ops.moe_ffn import reference as R
from te_jax_perm.ops.row_id_map.reference import row_id_map_reference, row_owner_reference

_GS = Operand("group_sizes", ("G",), ("int32",))
_OWNER = Operand("owner", ("M",), ("int32",))

# -- valid tuning operands: an owner table and group sizes from a real top-k dispatch --------
def _layout(t: int, g: int, m: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(group_sizes, owner)`` of a random top-k routing of ``t`` tokens over ``g`` experts
    dispatched into ``m`` rows."""
    k = max(1, min(g, m // max(t, 1)))
    rm = np.zeros((t, g), bool)
    np.put_along_axis(rm, np.argsort(rng.random((t, g)), axis=1)[:, :k], True, axis=1)
    rid, kept = row_id_map_reference(rm, m, xp=np)
    (owner,) = row_owner_reference(rid, np.zeros((g,), np.int32), num_out_rows=m, padded=False)
    return np.asarray(kept, np.int32), np.asarray(owner, np.int32)


def _example(dims, params, dtypes, rng):
    t, g, m = dims["T"], dims["G"], dims["M"]
    gs, owner = _layout(t, g, m, rng)
    rand = lambda *shape: (rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    return rand(t, dims["C"]).astype(dtypes["x"]), rand(g, dims["C"], dims["D"]).astype(dtypes["rhs"]), gs, owner


# -- declaration -----------------------------------------------------------------------------
moe_gather_gemm = declare(KernelDecl(
    name="moe_gather_gemm", kernel=K.moe_gather_gemm_kernel,
    operands=(Operand("x", ("T", "C"), FLOATS), Operand("rhs", ("G", "C", "D"), FLOATS), _GS, _OWNER),
    # M output rows of width D, in x's dtype.
    outputs=(Output("out", lambda dims, params: (dims["M"], dims["D"]), lambda dtypes, params: dtypes["x"]),),
    reference=R.moe_gather_gemm_reference, grid=mm_grid,
    constexprs=lambda dims, params, config: {"C": dims["C"], "D": dims["D"], "G": dims["G"],
                                              "G_P2": groups_p2(dims), "PRECISION": precision(params)},
    configs=MM_CONFIGS, constraints=(mm_fits,), default_config=mm_default, example_inputs=_example,
    # The token count T only sizes the gather's source, so it stays out of the tuning key.
    key_dims=("M", "C", "D", "G"),
    **{**GEMM_SHARED, "scalars": lambda dims, params: {"M": dims["M"], "T": dims["T"]}}))
