"""Small memcheck target: the permutation ops' kernels (dispatch, chunk sort and combine,
forward and backward; the grouped GEMM's run in the hostile-input memcheck) on the machine's
kernel backend, checked against the NumPy loop reference on the host - no XLA reference
computation, so what compute-sanitizer sees is our kernels plus a little glue.

    compute-sanitizer --tool memcheck python3 -m tests.gpu.memcheck_ops
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import te_jax_perm
from tests import numpy_reference as ref
from tests.conftest import routing
from tests.conftest import KERNEL_BACKEND

CASES = [  # T, H, E, k, align, drop
    (1, 64, 4, 1, None, 0), (33, 96, 16, 4, None, 0), (17, 130, 8, 2, 16, 3),
    (64, 72, 8, 8, 32, 0), (7, 64, 1, 1, None, 2),
]


def check_case(t, h, e, k, align, drop, rng) -> None:
    rm = routing(rng, t, e, k)
    x = rng.standard_normal((t, h)).astype(np.float32)
    probs = (rng.random((t, e)) * rm).astype(np.float32)
    n = max(int(rm.sum()) - drop, 0)
    b = KERNEL_BACKEND

    def layer(x, probs):
        out, pp, rid, pad, tpe = te_jax_perm.token_dispatch(x, rm, n, probs=probs, align_size=align, backend=b)
        sorted_out, smap = te_jax_perm.sort_chunks_by_index(
            out, jnp.array([out.shape[0] // 2, out.shape[0] - out.shape[0] // 2], jnp.int32),
            jnp.array([1, 0], jnp.int32), backend=b)
        back, _ = te_jax_perm.sort_chunks_by_map(sorted_out, smap, is_forward=False, backend=b)
        y = te_jax_perm.token_combine(back * 2.0, rid, merging_probs=probs, pad_offsets=pad, backend=b)
        return y, (out, pp)

    (y, (out, pp)), vjp = jax.vjp(layer, jnp.asarray(x), jnp.asarray(probs))
    gx, gp = vjp((jnp.ones_like(y), (jnp.zeros_like(out), jnp.zeros_like(pp))))
    e_out, e_pp, dest, _, _ = ref.dispatch(x, rm, n, probs, align)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(pp), e_pp)
    np.testing.assert_allclose(np.asarray(y), ref.combine(2.0 * e_out, dest, probs), rtol=1e-5, atol=1e-5)
    g_out, g_w = ref.combine_vjp(np.ones((t, h)), 2.0 * e_out, dest, probs)
    e_gx, _ = ref.dispatch_vjp(2.0 * g_out, None, dest)
    np.testing.assert_allclose(np.asarray(gx), e_gx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gp), g_w, rtol=1e-5, atol=1e-4)


def main() -> int:
    rng = np.random.default_rng(0)
    for case in CASES:
        check_case(*case, rng)
        print("MEMCHECK-CASE OK", case, flush=True)
    print(f"MEMCHECK-OPS PASS: {len(CASES)} cases on {KERNEL_BACKEND}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
