"""moe_ffn: the expert layer with dispatch and combine fused into its GEMMs, against the
unfused composition (token_dispatch -> grouped_matmul -> activation -> grouped_matmul ->
token_combine) and a float64 NumPy reference; forward and gradients, dropping and padding,
hostile routing (tokens with no expert, every token on one expert), under jit, vmap, and
lax.scan with jax.checkpoint (both the fused and the unfused layer); each fused
kernel against its reference and under the sanitizer with hostile owner tables and group
sizes; and a GPU-sized check (bit-identical reruns, unfused agreement) on the triton backend."""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax_perm
from te_jax_perm.ops.grouped_gemm.api import grouped_matmul
from te_jax_perm.ops.moe_ffn import decl as D
from te_jax_perm.ops.moe_ffn.reference import ACTIVATIONS, activate, moe_ffn_reference
from te_jax_perm.sanitize import sanitize
from tests.conftest import routing

HI = jax.lax.Precision.HIGHEST


@pytest.fixture(autouse=True)
def _highest_precision():
    # XLA:GPU multiplies float32 in TF32 by default; the references here must not.
    with jax.default_matmul_precision("highest"):
        yield


def _problem(t, h, e, k, f, activation, dtype, mode="uniform", seed=0, empty_tokens=0):
    rng = np.random.default_rng(seed)
    rm = routing(rng, t, e, k, mode)
    rm[:empty_tokens] = False                       # tokens routed to no expert
    n1 = 2 * f if ACTIVATIONS[activation][1] else f
    x = jnp.asarray(rng.standard_normal((t, h)), dtype)
    probs = jnp.asarray(rng.random((t, e)), jnp.float32)
    w_in = jnp.asarray(rng.standard_normal((e, h, n1)) / np.sqrt(h), dtype)
    w_out = jnp.asarray(rng.standard_normal((e, f, h)) / np.sqrt(f), dtype)
    return x, jnp.asarray(rm), probs, w_in, w_out


def unfused(x, rm, probs, w_in, w_out, num_out_tokens, activation="silu_glu", align_size=None, backend=None):
    """The composition moe_ffn fuses, on the same backend (the grouped GEMM on our kernels
    there, XLA's ragged dot on the xla backend)."""
    with te_jax_perm.use_backend(backend):
        rows, _, rid, pad, tpe = te_jax_perm.token_dispatch(x, rm, num_out_tokens, align_size=align_size)
        a = activate(activation, grouped_matmul(rows, w_in, tpe, backend=backend)).astype(rows.dtype)
        y = grouped_matmul(a, w_out, tpe, backend=backend)
        return te_jax_perm.token_combine(y, rid, merging_probs=probs, pad_offsets=pad)


def kept(rm, num_out_tokens):
    """[T, E] float32: 1 where the dispatch keeps (t, e)'s row (expert-major order < budget)."""
    rm = np.asarray(rm)
    order = np.cumsum(rm.T.ravel()).reshape(rm.T.shape).T - 1     # expert-major position of each entry
    return (rm & (order < num_out_tokens)).astype(np.float32)


def dense(x, probs, w_in, w_out, keep, activation):
    """Every expert on every token in float32, masked by the kept routing."""
    f32 = lambda a: a.astype(jnp.float32)                                  # noqa: E731
    a = activate(activation, jnp.einsum("th,ehf->tef", f32(x), f32(w_in), precision=HI))
    y = jnp.einsum("tef,efh->teh", a, f32(w_out), precision=HI)
    return jnp.einsum("te,teh->th", f32(probs) * keep, y, precision=HI)


def _close(got, want, tol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    assert np.all(np.isfinite(got)), f"{what}: non-finite values (an unwritten element?)"
    scale = max(np.abs(want).max(), 1e-3)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * scale, err_msg=what)


def value_and_grads(fn, rm, seed=9):
    """Jitted ``(x, probs, w_in, w_out) -> (y, (dx, dprobs, dw_in, dw_out))`` of ``fn(x, rm,
    probs, w_in, w_out)`` for one random output gradient (jitted: an eager call compiles
    every operation apart)."""
    def run(*args):
        y, vjp = jax.vjp(lambda x, p, wi, wo: fn(x, rm, p, wi, wo), *args)
        cot = jnp.asarray(np.random.default_rng(seed).standard_normal(y.shape), y.dtype)
        return y, vjp(cot)
    return jax.jit(run)


TOL = {"float32": 2e-5, "bfloat16": 3e-2}
# (T, H, E, k, F, activation, dtype, routing, tokens with no expert, rows dropped, align_size)
CASES = {
    "swiglu_fp32": (32, 32, 4, 2, 16, "silu_glu", "float32", "uniform", 0, 0, None),
    "gelu_bf16_drop_pad": (24, 32, 8, 2, 16, "gelu", "bfloat16", "hot", 0, 7, 4),
    "relu_no_expert_one_expert": (24, 16, 4, 1, 16, "relu", "float32", "all_one", 7, 0, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_gradients_match_unfused_and_numpy(backend, case):
    """Against the unfused composition on the xla backend (the unfused ops' own tests hold
    their kernels to it), NumPy float64, and for fp32 a dense float32 layer's gradients."""
    t, h, e, k, f, act, dtype, mode, empty, drop, align = CASES[case]
    x, rm, probs, w_in, w_out = _problem(t, h, e, k, f, act, dtype, mode, empty_tokens=empty)
    n = int(np.sum(rm)) - drop
    tol = TOL[dtype]
    args = (x, probs, w_in, w_out)
    y, got = value_and_grads(lambda *a: te_jax_perm.moe_ffn(*a, n, activation=act, align_size=align,
                                                            backend=backend), rm)(*args)
    want_y, want = value_and_grads(lambda *a: unfused(*a, n, act, align, "xla"), rm)(*args)
    assert y.shape == (t, h) and y.dtype == jnp.dtype(dtype)
    _close(y, moe_ffn_reference(x, rm, probs, w_in, w_out, n, act), tol, "forward vs numpy")
    _close(y, want_y, tol, "forward vs unfused")
    if empty:
        assert not np.asarray(y, np.float32)[:empty].any(), "tokens with no expert must give zeros"
    names = ("dx", "dprobs", "dw_in", "dw_out")
    for g, w, a, name in zip(got, want, args, names):
        assert g.dtype == a.dtype, name
        _close(g, w, tol, f"{name} vs unfused")
    if dtype == "float32":
        keep = kept(rm, n)
        _, dense_grads = value_and_grads(lambda x, rm, p, wi, wo: dense(x, p, wi, wo, keep, act), rm)(*args)
        for g, w, name in zip(got, dense_grads, names):
            _close(g, w, tol, f"{name} vs dense")
    # Off-route and dropped probabilities get no gradient.
    assert not np.asarray(got[1])[kept(rm, n) == 0].any()


def test_under_jit_with_a_traced_routing_map_and_aliases_audited(kernel_backend):
    x, rm, probs, w_in, w_out = _problem(16, 32, 4, 2, 16, "silu_glu", "float32", seed=3)

    def loss(x, rm, p, wi, wo):
        return jnp.sum(te_jax_perm.moe_ffn(x, rm, p, wi, wo, 32, backend=kernel_backend) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4)))
    val, grads = step(x, rm, probs, w_in, w_out)
    val2, grads2 = step(x, rm, probs, w_in, w_out)
    assert float(val) == float(val2) and all(np.array_equal(a, b) for a, b in zip(grads, grads2)), \
        "two runs of one step must be bit-identical"
    ref_val, ref_grads = jax.jit(jax.value_and_grad(
        lambda x, p, wi, wo: jnp.sum(unfused(x, rm, p, wi, wo, 32, backend=kernel_backend) ** 2),
        argnums=(0, 1, 2, 3)))(x, probs, w_in, w_out)
    _close(val, ref_val, 1e-5, "loss")
    for g, w in zip(grads, ref_grads):
        _close(g, w, 2e-5, "grad")
    report = te_jax_perm.audit_aliases(step, x, rm, probs, w_in, w_out)
    if kernel_backend == "interpret":   # the triton backend's calls are audited the same way on a GPU
        assert report.ok, report


def test_batch_shape_dtype_promotion_and_empty_budget():
    x, rm, probs, w_in, w_out = _problem(12, 16, 4, 2, 8, "silu", "bfloat16", seed=4)
    w_in32 = w_in.astype(jnp.float32)

    @jax.jit
    def run(x, rm, probs):
        ffn = lambda x, n: te_jax_perm.moe_ffn(x, rm.reshape(x.shape[:-1] + (4,)),  # noqa: E731
                                               probs.reshape(x.shape[:-1] + (4,)), w_in32, w_out, n,
                                               activation="silu", backend="xla")
        y = ffn(x.reshape(3, 4, 16), 24)
        g = jax.grad(lambda x: jnp.sum(ffn(x, 24).astype(jnp.float32)))(x)
        return y, g, ffn(x, 0)

    y, g, zero = run(x, rm, probs)
    assert y.shape == (3, 4, 16) and y.dtype == jnp.float32        # bf16 x, fp32 w_in: computed in fp32
    _close(y.reshape(12, 16), moe_ffn_reference(x, rm, probs, w_in32, w_out, 24, "silu"), 1e-2, "promoted")
    assert g.dtype == jnp.bfloat16 and g.shape == x.shape and np.asarray(g, np.float32).any()
    assert zero.shape == (12, 16) and not np.asarray(zero).any()    # a budget of 0 rows: nothing reaches an expert


def test_vmap_over_token_batches_sharing_the_weights(backend):
    """One set of expert weights for a vmapped batch of token blocks (as micro-batches share
    a layer), forward and gradients: equals each block on its own."""
    blocks = [_problem(12, 16, 4, 2, 8, "silu_glu", "float32", seed=s) for s in (12, 13)]
    x, rm, probs = (jnp.stack([blk[i] for blk in blocks]) for i in range(3))
    w_in, w_out = blocks[0][3], blocks[0][4]
    f = lambda x, rm, p, wi, wo: te_jax_perm.moe_ffn(x, rm, p, wi, wo, 20, backend=backend)  # noqa: E731
    vf = jax.vmap(f, in_axes=(0, 0, 0, None, None))
    batched = lambda x, p, wi: jnp.sum(vf(x, rm, p, wi, w_out) ** 2)  # noqa: E731
    looped = lambda x, p, wi: sum(jnp.sum(f(x[b], rm[b], p[b], wi, w_out) ** 2) for b in range(2))  # noqa: E731
    # Each side one compiled program (op by op, the looped side compiled every small op apart).
    (loss, grads), (want_loss, wants) = (jax.jit(jax.value_and_grad(fn, (0, 1, 2)))(x, probs, w_in)
                                         for fn in (batched, looped))
    _close(loss, want_loss, 2e-5, "loss")
    for got, want in zip(grads, wants):
        _close(got, want, 2e-5, "gradient")


def test_vmap_over_independent_layers(backend):
    """A batch of layers (own tokens, routing and weights each) under vmap, forward and
    gradients, equals each layer on its own."""
    layers = [_problem(12, 16, 4, 2, 8, "silu_glu", "float32", seed=s) for s in (10, 11)]
    x, rm, probs, w_in, w_out = (jnp.stack([layer[i] for layer in layers]) for i in range(5))
    def grad(backend):
        f = lambda x, rm, p, wi, wo: te_jax_perm.moe_ffn(x, rm, p, wi, wo, 20, backend=backend)  # noqa: E731
        return jax.value_and_grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 2, 3, 4))

    loss, g = jax.jit(jax.vmap(grad(backend)))(x, rm, probs, w_in, w_out)
    for b, layer in enumerate(layers):
        want_loss, want = jax.jit(grad("xla"))(*layer)   # one layer, on the reference backend
        _close(loss[b], np.sum(moe_ffn_reference(*layer, 20) ** 2), 2e-5, f"layer {b}")
        _close(loss[b], want_loss, 2e-5, f"layer {b}")
        for got, w in zip(g, want):
            _close(got[b], w, 2e-5, f"layer {b} gradient")


@pytest.mark.parametrize("fused", [True, False], ids=["moe_ffn", "unfused"])
def test_layers_under_scan_and_remat_match_the_unrolled_layers(backend, fused):
    """A stack of MoE layers as training stacks run them: ``lax.scan`` over the layers'
    weights, each layer under ``jax.checkpoint`` (recomputed in the backward, wholly or
    keeping its matmuls), routing computed from the layer's input (traced). Loss and
    gradients equal the unrolled stack's without recomputation, and the xla backend's."""
    layers, t, h, e, k, f = 2, 12, 16, 4, 2, 8
    rng = np.random.default_rng(21)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    w_router = jnp.asarray(rng.standard_normal((layers, h, e)), jnp.float32)
    w_in = jnp.asarray(rng.standard_normal((layers, e, h, 2 * f)) / np.sqrt(h), jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((layers, e, f, h)) / np.sqrt(f), jnp.float32)

    def layer(be, hid, weights):
        wr, wi, wo = weights
        logits = hid @ wr
        top = jax.lax.top_k(logits, k)[1]
        rm = jnp.zeros((t, e), bool).at[jnp.arange(t)[:, None], top].set(True)
        probs = jax.nn.softmax(logits, axis=-1)
        ffn = te_jax_perm.moe_ffn if fused else unfused
        return hid + ffn(hid, rm, probs, wi, wo, t * k, backend=be), None

    def loss(be, remat, scan, x, *weights):
        step = functools.partial(layer, be)
        if remat:
            step = jax.checkpoint(step, policy=remat)
        if scan:
            hid, _ = jax.lax.scan(step, x, weights)
        else:
            hid = x
            for i in range(layers):
                hid, _ = step(hid, tuple(w[i] for w in weights))
        return jnp.sum(hid ** 2)

    args = (x, w_router, w_in, w_out)
    grad = lambda be, remat, scan: jax.jit(jax.value_and_grad(  # noqa: E731
        functools.partial(loss, be, remat, scan), argnums=(0, 1, 2, 3)))(*args)
    want_loss, wants = grad("xla", None, False)
    policies = jax.checkpoint_policies
    for remat, scan in ((None, True), (policies.nothing_saveable, False), (policies.nothing_saveable, True),
                        (policies.dots_saveable, True)):
        got_loss, gots = grad(backend, remat, scan)
        what = f"{backend}, remat {getattr(remat, '__name__', None)}, scan {scan}"
        _close(got_loss, want_loss, 2e-5, what)
        for got, want in zip(gots, wants):
            _close(got, want, 2e-5, f"{what} gradient")


def test_values_off_the_route_are_never_read(kernel_backend):
    """NaN probabilities off the route and inf rows of tokens with no expert leave the output
    and every gradient finite: no kernel reads them."""
    x, rm, probs, w_in, w_out = _problem(12, 16, 4, 2, 8, "silu_glu", "float32", empty_tokens=3)
    probs, x = jnp.where(rm, probs, jnp.nan), x.at[:3].set(jnp.inf)
    def loss(x, p):
        return jnp.sum(te_jax_perm.moe_ffn(x, rm, p, w_in, w_out, 20, backend=kernel_backend) ** 2)

    val, (dx, dprobs) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, probs)
    assert np.isfinite(float(val)) and np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dprobs)).all()
    assert not np.asarray(dx)[:3].any()


def test_bad_arguments_name_what_they_are():
    x, rm, probs, w_in, w_out = _problem(8, 16, 4, 2, 8, "silu_glu", "float32")
    call = lambda **kw: te_jax_perm.moe_ffn(**{**dict(x=x, routing_map=rm, probs=probs, w_in=w_in,  # noqa: E731
                                                      w_out=w_out, num_out_tokens=16, backend="xla"), **kw})
    with pytest.raises(ValueError, match=r"w_in has shape \(4, 16, 15\); expected \[E=4, H=16, 2F\]"):
        call(w_in=w_in[..., :15])
    with pytest.raises(ValueError, match=r"w_out has shape \(4, 8, 8\); expected \[E=4, F=8, H=16\]"):
        call(w_out=w_out[..., :8])
    # Gated weights with a plain activation, and plain ones with a gated activation: named as such.
    with pytest.raises(ValueError, match=r"w_out has shape \(4, 8, 16\), which fits w_in \(4, 16, 16\) as a gated "
                                         r"activation's weights, but activation='silu' is not gated"):
        call(activation="silu")
    with pytest.raises(ValueError, match=r"w_out has shape \(4, 8, 16\), which fits w_in \(4, 16, 8\) as a plain "
                                         r"activation's weights, but activation='silu_glu' is gated"):
        call(w_in=w_in[..., :8])
    with pytest.raises(ValueError, match=r"probs has shape \(8, 3\); expected \(8, 4\)"):
        call(probs=probs[:, :3])
    with pytest.raises(ValueError, match=r"routing_map has shape \(7, 4\); expected 8 tokens like x"):
        call(routing_map=rm[:7])
    with pytest.raises(ValueError, match=r"activation='tanh'; expected one of"):
        call(activation="tanh")
    with pytest.raises(TypeError, match=r"x has dtype float64|x has dtype int32"):
        call(x=x.astype(jnp.int32))
    with pytest.raises(TypeError, match=r"num_out_tokens must be a static Python int"):
        call(num_out_tokens=16.0)


def test_example_fused_layer_matches_its_dense_reference(kernel_backend):
    """examples/moe_permute.py --gemm=fused: one training step of the layer on moe_ffn against a
    dense layer (loss, output, and the input, router and both weights' gradients)."""
    from examples import moe_permute as example
    cfg = example.MoEConfig(tokens=16, hidden=16, ffn=16, experts=4, topk=2, align_size=4,
                            backend=kernel_backend, gemm="fused")
    errors = example.check(cfg)
    assert max(errors.values()) <= example.TOLERANCE["float32"], errors


# -- each fused kernel against its reference, hostile tables included --------------------------
def _kernel_operands(seed, hostile):
    """Operands of every fused kernel: T=30 tokens, G=3 experts, M=80 rows, groups of more
    rows than one row tile holds (so tiles follow each other within a group, the last one
    partial); hostile: owners that are negative, name tokens past T or sit past the groups,
    group sizes that are negative or sum past M."""
    rng = np.random.default_rng(seed)
    t, g, m, c, d = 30, 3, 80, 24, 40
    if hostile:
        gs = np.array([-4, 45, 200], np.int32)
        owner = rng.integers(-5, t * g + 12, m).astype(np.int32)
        owner[[0, 5]] = 2**31 - 1
    else:
        gs = np.array([36, 0, 39], np.int32)
        owner = np.zeros(m, np.int32)
        owner[:75] = rng.permutation(t * g)[:75] + 1
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)     # noqa: E731
    gs, owner = jnp.asarray(gs), jnp.asarray(owner)
    return {
        D.moe_gather_gemm: (f(t, c), f(g, c, d), gs, owner),
    }


@pytest.mark.parametrize("hostile", [False, True], ids=["dispatch_tables", "hostile_tables"])
def test_every_fused_kernel_matches_its_reference_and_sanitizes_clean(kernel_backend, hostile):
    # The sanitizer watches the interpreter's launches; on a GPU the kernels run compiled.
    with (sanitize() if kernel_backend == "interpret" else contextlib.nullcontext()) as report:
        for prim, ops in _kernel_operands(5, hostile).items():
            (got,) = prim(*ops, backend=kernel_backend, elem_bytes=4)
            (want,) = prim(*ops, backend="xla", elem_bytes=4)
            _close(got, want, 1e-5, prim.decl.name)
    if kernel_backend == "interpret":
        assert report.launches and not report, report.text()


def test_the_op_sanitizes_clean_forward_and_backward(on_cpu):
    x, rm, probs, w_in, w_out = _problem(12, 16, 4, 2, 8, "silu_glu", "float32", mode="hot", seed=6,
                                         empty_tokens=2)
    with sanitize() as report:
        jax.block_until_ready(jax.grad(lambda *a: jnp.sum(te_jax_perm.moe_ffn(
            a[0], rm, a[1], a[2], a[3], 17, align_size=4, backend="interpret") ** 2), argnums=(0, 1, 2, 3))(
                x, probs, w_in, w_out))
    launched = {s.kernel for s in report.launches}
    # The forward's gathering GEMM, the grouped GEMM on the scaled activations and the
    # combine's gather; the backward's row moves, the grouped GEMM's input and weight
    # gradients on the moved rows, and the gather into the tokens.
    backward = {"grouped_gemm", "unpermute", "permute", "grouped_gemm_rhs_t", "grouped_gemm_wgrad",
                "permute_bwd_probs"}
    assert {d.decl.name for d in _kernel_operands(0, False)} | backward <= launched, launched
    assert not report, report.text()


# -- GPU: a real size -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_real_size_matches_unfused_and_is_deterministic(dtype):
    t, h, e, k, f = 4096, 1024, 16, 2, 512
    x, rm, probs, w_in, w_out = _problem(t, h, e, k, f, "silu_glu", dtype, mode="hot", seed=7)
    n = t * k - 100
    args = (x, probs, w_in, w_out)
    # A fixed output gradient rather than a loss: the check covers the op's own results, not
    # a reduction XLA may order differently from run to run.
    fused = value_and_grads(lambda *a: te_jax_perm.moe_ffn(*a, n, backend="triton"), rm)
    got = fused(*args)
    again = fused(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), "reruns must be bit-identical"
    want = value_and_grads(lambda *a: unfused(*a, n, backend="triton"), rm)(*args)
    tol = 2e-2 if dtype == "bfloat16" else 1e-4
    for g, w, name in zip(jax.tree.leaves(got), jax.tree.leaves(want), ("y", "dx", "dprobs", "dw_in", "dw_out")):
        _close(g, w, tol, f"{name}: fused vs unfused")


def test_hopper_first_gemm_on_moved_rows_matches_the_gathering_kernel(monkeypatch, on_cpu):
    """Where the grouped GEMM loads rows by TMA (Hopper), the first GEMM runs on rows the
    permute kernel moved into place: the same layer, values and gradients, with padding and
    dropped rows; the gathering kernel is not launched. (The branch is forced on the
    interpreter here; on a GPU it runs where the device is Hopper.)"""
    from te_jax_perm.ops.moe_ffn import api
    x, rm, probs, w_in, w_out = _problem(12, 16, 4, 2, 8, "silu_glu", "float32", mode="hot", seed=3,
                                         empty_tokens=2)
    op = lambda *a: te_jax_perm.moe_ffn(*a, 17, align_size=4, backend="interpret")  # noqa: E731
    want = value_and_grads(op, rm)(x, probs, w_in, w_out)
    monkeypatch.setattr(api, "on_hopper", lambda backend: backend == "interpret")
    with sanitize() as report:
        got = value_and_grads(op, rm)(x, probs, w_in, w_out)
    for g, w, name in zip(jax.tree.leaves(got), jax.tree.leaves(want), ("y", "dx", "dprobs", "dw_in", "dw_out")):
        _close(g, w, 1e-5, f"{name}: moved rows vs gathering kernel")
    launched = {s.kernel for s in report.launches}
    assert "moe_gather_gemm" not in launched and {"permute", "grouped_gemm"} <= launched, launched
    assert not report, report.text()


@pytest.mark.parametrize("shards,align,want_align", [(1, 4, 4), (8, 2, 2), (8, 4, None), (4, None, None)])
def test_a_token_shard_pads_only_where_its_rows_hold_the_padded_layout(shards, align, want_align):
    """moe_ffn's rows are a multiple of T; a shard gets its share of them and of
    num_out_tokens, and keeps align_size only where its rows hold the padded layout (the
    result is the same either way; dropping rows to make room would change it)."""
    from te_jax_perm.ops.moe_ffn.api import Layer, layer_rows
    from te_jax_perm.ops.permute.api import dispatch_rows
    t, e, n = 32, 4, 64
    rows = layer_rows(t, dispatch_rows(n, e, align)[1])
    assert rows % t == 0 and rows >= dispatch_rows(n, e, align)[1]
    local_rows, budget, got = Layer(t, n, align, rows, "silu", "xla").shard(t // shards, e)
    assert (local_rows, budget, got) == (rows // shards, n // shards, want_align)
