"""Mistakes caught where they can be: concrete arguments checked before any cast, values of
concrete maps and offsets checked, traced ones under TE_JAX_PERM_CHECKS=1, and routing
formats converted by helpers instead of silently misread."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax_perm
from te_jax_perm.core.checks import CheckError

X = jnp.zeros((10, 4), jnp.float32)


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("arg", ["split_sizes", "sorted_indices"])
@pytest.mark.parametrize("wide", [np.asarray, jnp.asarray, list])
def test_int64_chunk_arguments_are_checked_before_the_int32_cast(x64, arg, wide):
    big = wide(np.array([2**32 + 3, 7], np.int64))
    sizes, order = (big, [1, 0]) if arg == "split_sizes" else ([3, 7], big)
    with pytest.raises(ValueError, match=rf"{arg} = \[4294967299, 7\] has entries outside int32"):
        te_jax_perm.sort_chunks_by_index(X, sizes, order)


def test_int64_sizes_are_checked_without_x64_too():
    with pytest.raises(ValueError, match=r"split_sizes = \[4294967299, 7\] has entries outside int32"):
        te_jax_perm.sort_chunks_by_index(X, np.array([2**32 + 3, 7]), np.array([1, 0]))


def test_offsets_counts_and_static_sizes_must_be_integers():
    rm = np.eye(4, dtype=bool)[[0, 1, 2, 3, 0, 1]]
    out, _, rid, pad, tpe = te_jax_perm.token_dispatch(np.ones((6, 8), np.float32), rm, 6, align_size=2)
    with pytest.raises(TypeError, match="pad_offsets has dtype float32; expected an integer dtype"):
        te_jax_perm.token_combine(out, rid, None, pad.astype(jnp.float32))
    rid0, kept = te_jax_perm.make_row_id_map(rm)
    with pytest.raises(TypeError, match="tokens_per_expert has dtype float32; expected an integer dtype"):
        te_jax_perm.permute_with_mask_map(jnp.ones((6, 8)), rid0, kept.astype(jnp.float32), 6)
    with pytest.raises(TypeError, match="tokens_per_expert has dtype float32; expected an integer dtype"):
        te_jax_perm.unpermute_with_mask_map(jnp.ones((6, 8)), rid0, tokens_per_expert=kept.astype(jnp.float32))
    with pytest.raises(TypeError, match="num_tokens must be a static Python int, got float 3.7"):
        te_jax_perm.make_chunk_sort_map(jnp.array([1, 2]), jnp.array([1, 0]), 3.7)


def test_topk_indices_passed_as_a_routing_map_are_rejected_with_the_conversion():
    topk = np.array([[0, 3], [2, 1], [3, 0]], np.int32)   # [T, k] expert ids, E = 4
    for call in (lambda m: te_jax_perm.token_dispatch(np.ones((3, 8), np.float32), m, 6),
                 lambda m: te_jax_perm.make_row_id_map(m)):
        with pytest.raises(ValueError, match=r"routing_map holds values other than 0 and 1 \(e.g. \[2, 3\]\).*"
                                             r"topk_to_routing_map\(indices, num_experts\)"):
            call(topk)
    rm = te_jax_perm.topk_to_routing_map(topk, 4)
    assert rm.dtype == jnp.bool_ and rm.shape == (3, 4)
    np.testing.assert_array_equal(np.asarray(rm), [[1, 0, 0, 1], [0, 1, 1, 0], [1, 0, 0, 1]])
    np.testing.assert_array_equal(np.asarray(te_jax_perm.routing_map_to_topk(rm, 3)),
                                  [[0, 3, -1], [1, 2, -1], [0, 3, -1]])
    with pytest.raises(ValueError, match=r"indices hold \[4\]; expected expert ids in \[0, num_experts=4\)"):
        te_jax_perm.topk_to_routing_map(topk + 1, 4)
    # routing_map_to_topk fills a short row with -1; its indices convert back, concrete or
    # traced, to the map they came from. Other negative ids are still refused.
    short = np.asarray(rm).copy()
    short[1] = [0, 0, 1, 0]                                   # one expert, k = 2: one -1
    back = te_jax_perm.routing_map_to_topk(short, 2)
    assert (np.asarray(back) == -1).any()
    np.testing.assert_array_equal(np.asarray(te_jax_perm.topk_to_routing_map(back, 4)), short)
    np.testing.assert_array_equal(np.asarray(jax.jit(te_jax_perm.topk_to_routing_map, static_argnums=1)(back, 4)),
                                  short)
    with pytest.raises(ValueError, match=r"indices hold \[-2\]; expected expert ids in \[0, num_experts=4\), or -1"):
        te_jax_perm.topk_to_routing_map(topk - 2, 4)
    out = te_jax_perm.token_dispatch(np.ones((3, 8), np.float32), rm.astype(jnp.int8), 6)[0]   # 0/1 ints are fine
    assert out.shape == (6, 8)


def test_unpadded_map_with_pad_offsets_raises():
    rng = np.random.default_rng(0)
    rm = np.zeros((6, 4), bool)
    rm[np.arange(6), rng.integers(0, 4, 6)] = True
    x = rng.standard_normal((6, 8)).astype(np.float32)
    out, _, rid, pad, _ = te_jax_perm.token_dispatch(x, rm, 6, align_size=4)
    assert np.asarray(pad).any()
    np.testing.assert_allclose(np.asarray(te_jax_perm.token_combine(out, rid, None, pad)), x)   # the padded map
    out0, _, rid0, _, _ = te_jax_perm.token_dispatch(x, rm, 6)
    with pytest.raises(CheckError, match=r"row_id_map holds unpadded destinations.*pad_offsets = \["):
        te_jax_perm.token_combine(out, rid0, None, pad)


def test_padded_map_with_pad_offsets_in_the_lower_level_ops_raises(monkeypatch):
    # token_dispatch's map addresses the padded rows already: the lower-level ops, which pad
    # make_row_id_map's unpadded map, would pad it a second time and scatter rows onto other
    # experts' rows.
    rng = np.random.default_rng(1)
    rm = np.zeros((6, 4), bool)
    rm[np.arange(6), rng.integers(0, 4, 6)] = True
    x = rng.standard_normal((6, 8)).astype(np.float32)
    out, _, rid, pad, tpe = te_jax_perm.token_dispatch(x, rm, 6, align_size=4)
    assert np.asarray(pad)[np.unique(np.nonzero(rm)[1])].any()
    again = r"row_id_map already addresses padded rows.*pad_offsets = \[.*would pad them a second time"
    with pytest.raises(CheckError, match=again):
        te_jax_perm.permute_with_mask_map(x, rid, tpe, out.shape[0], pad_offsets=pad)
    with pytest.raises(CheckError, match=again):
        te_jax_perm.unpermute_with_mask_map(out, rid, pad_offsets=pad)
    # Without pad_offsets the padded map moves rows as the dispatch did.
    np.testing.assert_array_equal(np.asarray(te_jax_perm.permute_with_mask_map(x, rid, tpe, out.shape[0])[0]),
                                  np.asarray(out))
    np.testing.assert_array_equal(np.asarray(te_jax_perm.unpermute_with_mask_map(out, rid)), x)
    # make_row_id_map's unpadded map takes the same pad_offsets.
    rid0, _ = te_jax_perm.make_row_id_map(rm, 6)
    np.testing.assert_array_equal(
        np.asarray(te_jax_perm.permute_with_mask_map(x, rid0, tpe, out.shape[0], pad_offsets=pad)[0]),
        np.asarray(out))
    # A traced map is checked when the program runs, in the checked mode.
    monkeypatch.setenv("TE_JAX_PERM_CHECKS", "1")
    permute = jax.jit(lambda r: te_jax_perm.permute_with_mask_map(x, r, tpe, out.shape[0], pad_offsets=pad)[0])
    with pytest.raises(Exception, match=again):
        jax.block_until_ready(permute(rid))


def test_concrete_maps_that_do_not_fit_their_input_raise():
    rm = np.eye(4, dtype=bool)[[0, 1, 2, 3]]
    out, _, rid, _, _ = te_jax_perm.token_dispatch(np.ones((4, 8), np.float32), rm, 4)
    with pytest.raises(CheckError, match=r"row_id_map addresses rows \[3\], but inp has 3 rows"):
        te_jax_perm.token_combine(out[:3], rid)
    with pytest.raises(TypeError, match="row_id_map is a list; expected an int32 array"):
        te_jax_perm.token_combine(out, np.asarray(rid).tolist())
    with pytest.raises(CheckError, match=r"row_id_map names output rows \[2\] more than once"):
        te_jax_perm.sort_chunks_by_map(X, jnp.array([2, 2, 0, 1, 3, 4, 5, 6, 7, 8], jnp.int32))
    with pytest.raises(CheckError, match=r"row_id_map has entries \[10\] outside \[-1, N=10\)"):
        te_jax_perm.sort_chunks_by_map(X, jnp.array([10, 1, 0, 2, 3, 4, 5, 6, 7, 8], jnp.int32))


# -- the checked mode ----------------------------------------------------------------------
@pytest.fixture
def checked(monkeypatch):
    monkeypatch.setenv("TE_JAX_PERM_CHECKS", "1")


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_checked_mode_rejects_traced_values_when_the_program_runs(checked, backend):
    # A jitted interpret call lowers for the CPU only: on a GPU machine, place it there.
    with jax.default_device(jax.devices("cpu")[0]):
        sort = jax.jit(lambda s, o: te_jax_perm.sort_chunks_by_index(X, s, o, backend=backend)[0])
        jax.block_until_ready(sort(jnp.array([3, 7]), jnp.array([1, 0])))                      # fine
        with pytest.raises(Exception, match=r"sorted_indices = \[0, 0\] is not a permutation of range\(2\)"):
            jax.block_until_ready(sort(jnp.array([3, 7]), jnp.array([0, 0])))
        with pytest.raises(Exception, match=r"split_sizes has negative entries"):
            jax.block_until_ready(sort(jnp.array([-3, 7]), jnp.array([1, 0])))
        dispatch = jax.jit(lambda m: te_jax_perm.token_dispatch(jnp.ones((3, 8)), m, 6, backend=backend)[0])
        with pytest.raises(Exception, match="routing_map holds values other than 0 and 1"):
            jax.block_until_ready(dispatch(jnp.array([[0, 3], [2, 1], [3, 0]], jnp.int32)))
        rm = np.eye(4, dtype=bool)[[0, 1, 2, 3]]
        out, _, rid, _, _ = te_jax_perm.token_dispatch(np.ones((4, 8), np.float32), rm, 4, backend=backend)
        combine = jax.jit(lambda a, r: te_jax_perm.token_combine(a, r, backend=backend))
        with pytest.raises(Exception, match=r"row_id_map addresses rows \[3\], but inp has 3 rows"):
            jax.block_until_ready(combine(out[:3], rid))
        by_map = jax.jit(lambda m: te_jax_perm.sort_chunks_by_map(X, m, backend=backend)[0])
        with pytest.raises(Exception, match=r"row_id_map names output rows \[2\] more than once"):
            jax.block_until_ready(by_map(jnp.array([2, 2, 0, 1, 3, 4, 5, 6, 7, 8], jnp.int32)))


def test_without_the_checked_mode_traced_values_get_the_defined_result(monkeypatch):
    monkeypatch.delenv("TE_JAX_PERM_CHECKS", raising=False)
    out = jax.jit(lambda s, o: te_jax_perm.sort_chunks_by_index(X + 1, s, o)[0])(jnp.array([3, 7]), jnp.array([0, 0]))
    np.testing.assert_array_equal(np.asarray(out)[:, 0], [1] * 3 + [0] * 7)


# -- errors that help --------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_sizes_past_int32_rows_raise_our_message(backend):
    x, rm = np.ones((4, 8), np.float32), np.eye(4, dtype=bool)
    with pytest.raises(ValueError, match=r"num_out_tokens must be <= 2147483647 \(int32 row indices\), got 2147483648"):
        te_jax_perm.token_dispatch(x, rm, 2**31, backend=backend)
    with pytest.raises(ValueError, match=r"num_out_tokens must be <= 2147483647"):
        te_jax_perm.make_row_id_map(rm, 2**31, backend=backend)
    with pytest.raises(ValueError, match=r"align_size = 536870912 with num_out_tokens = 4 and E = 4 pads up to "
                                         r"2147483648 rows; expected at most 2\*\*31 - 1 rows"):
        te_jax_perm.token_dispatch(x, rm, 4, align_size=2**29, backend=backend)
    # Rounded down to a multiple of 3 the output would have 2**31 - 2 rows, but the padded
    # layout reaches 2**31: refused naming the arguments, not the kernel's budget.
    with pytest.raises(ValueError, match=r"align_size = 3 with num_out_tokens = 2147483640 and E = 4 pads up to "
                                         r"2147483648 rows"):
        te_jax_perm.token_dispatch(x, rm, 2**31 - 8, align_size=3, backend=backend)


def test_the_largest_int32_row_counts_are_taken(backend):
    """2**31 - 1 output rows (of no columns) are within int32 row indices: the ops trace and
    lower there (running them would need an 8 GiB owner table)."""
    x, rm = np.ones((4, 0), np.float32), np.eye(4, dtype=bool)
    rid, kept = te_jax_perm.make_row_id_map(rm, backend="xla")
    calls = [lambda x, rm: te_jax_perm.token_dispatch(x, rm, 2**31 - 1, backend=backend)[0],
             lambda x, rm: te_jax_perm.token_dispatch(x, rm, 2**31 - 13, align_size=4, backend=backend)[0],
             lambda x, rm: te_jax_perm.permute_with_mask_map(x, rid, kept, 2**31 - 1, backend=backend)[0]]
    for call in calls:
        assert jax.jit(call).lower(x, rm) is not None


def test_backend_by_position_says_it_is_keyword_only():
    x, rm = np.ones((4, 8), np.float32), np.eye(4, dtype=bool)
    with pytest.raises(TypeError, match=r"token_dispatch takes at most 5 positional arguments, got 6: backend is "
                                        r"keyword-only; pass backend='xla'"):
        te_jax_perm.token_dispatch(x, rm, 4, None, None, "xla")
    with pytest.raises(TypeError, match="sort_chunks_by_index takes at most 3 .* pass backend='interpret'"):
        te_jax_perm.sort_chunks_by_index(X, [10], [0], "interpret")
    rid, tpe = te_jax_perm.make_row_id_map(rm, 4, backend="xla")
    for call, most in ((lambda: te_jax_perm.permute_with_mask_map(x, rid, tpe, 4, None, None, "xla"), 6),
                       (lambda: te_jax_perm.unpermute_with_mask_map(x, rid, None, None, None, "xla"), 5),
                       (lambda: te_jax_perm.make_chunk_sort_map([2, 2], [1, 0], 4, "xla"), 3),
                       (lambda: te_jax_perm.sort_chunks_by_map(x, np.arange(4), None, True, "xla"), 4)):
        with pytest.raises(TypeError, match=f"takes at most {most} positional arguments, got {most + 1}: backend "
                                            "is keyword-only; pass backend='xla'"):
            call()


def test_too_many_positional_arguments_name_every_keyword_only_parameter():
    """A seventh positional argument to moe_ffn is its activation, not its backend."""
    x, rm = np.ones((4, 8), np.float32), np.eye(4, dtype=bool)
    w_in, w_out = np.ones((4, 8, 6), np.float32), np.ones((4, 3, 8), np.float32)
    with pytest.raises(TypeError, match=r"^moe_ffn takes at most 6 positional arguments, got 7: activation, "
                                        r"align_size and backend are keyword-only$"):
        te_jax_perm.moe_ffn(x, rm, rm.astype(np.float32), w_in, w_out, 4, "silu_glu")
    with pytest.raises(TypeError, match=r"got 7: activation, align_size and backend are keyword-only; "
                                        r"pass backend='xla'$"):
        te_jax_perm.moe_ffn(x, rm, rm.astype(np.float32), w_in, w_out, 4, "xla")
    with pytest.raises(TypeError, match=r"make_row_id_map takes at most 2 positional arguments, got 3: "
                                        r"block_tokens, single_pass and backend are keyword-only$"):
        te_jax_perm.make_row_id_map(rm, 4, 64)


def test_backend_names_are_case_insensitive_as_in_the_environment():
    out, _ = te_jax_perm.sort_chunks_by_index(X + 1, [10], [0], backend="XLA")
    np.testing.assert_array_equal(np.asarray(out), np.ones((10, 4)))
    with te_jax_perm.use_backend("Interpret") as name:
        assert name == "interpret" and te_jax_perm.core.resolve_backend() == "interpret"
    with pytest.raises(TypeError, match="backend must be a string, got int 1"):
        te_jax_perm.sort_chunks_by_index(X, [10], [0], backend=1)


@pytest.mark.parametrize("word,on", [("1", True), ("yes", True), ("On", True), ("TRUE", True),
                                     ("0", False), ("no", False), ("off", False), ("False", False)])
def test_on_off_switches_take_the_same_words(monkeypatch, word, on):
    from te_jax_perm.core import env
    for var in (env.AUTOTUNE, env.SANITIZE, env.CHECKS):
        monkeypatch.setenv(var, word)
    assert env.autotune() is on and env.checks() is on and env.sanitize() == ("collect" if on else None)


# -- arguments checked as given --------------------------------------------------------------
_RM = np.eye(4, dtype=bool)[[0, 1, 2, 3, 0, 1]]


@pytest.mark.parametrize("arg", ["inp", "tokens_per_expert", "probs", "pad_offsets"])
def test_permute_with_mask_map_takes_lists_as_token_dispatch_does(arg):
    x, probs = np.arange(48, dtype=np.float32).reshape(6, 8), np.full((6, 4), 0.5, np.float32)
    rid, kept = te_jax_perm.make_row_id_map(_RM, backend="xla")
    args = dict(inp=x, tokens_per_expert=np.asarray(kept), probs=probs, pad_offsets=np.zeros(4, np.int32))
    call = lambda a: te_jax_perm.permute_with_mask_map(a["inp"], rid, a["tokens_per_expert"], 6, a["probs"],
                                                       a["pad_offsets"], backend="xla")
    want = call(args)
    got = call({**args, arg: args[arg].tolist()})
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("arg", ["inp", "merging_probs", "pad_offsets", "tokens_per_expert"])
def test_unpermute_with_mask_map_takes_lists_as_token_combine_does(arg):
    rid, kept = te_jax_perm.make_row_id_map(_RM, backend="xla")
    args = dict(inp=np.arange(48, dtype=np.float32).reshape(6, 8), merging_probs=np.full((6, 4), 0.5, np.float32),
                pad_offsets=np.zeros(4, np.int32), tokens_per_expert=np.asarray(kept))
    call = lambda a: te_jax_perm.unpermute_with_mask_map(a["inp"], rid, a["merging_probs"], a["pad_offsets"],
                                                         a["tokens_per_expert"], backend="xla")
    np.testing.assert_array_equal(np.asarray(call({**args, arg: args[arg].tolist()})), np.asarray(call(args)))


_W_IN, _W_OUT = np.ones((4, 8, 12), np.float32), np.ones((4, 6, 8), np.float32)


@pytest.mark.parametrize("call,error,message", [
    (lambda: te_jax_perm.make_row_id_map(_RM, block_tokens=2.0), TypeError,
     "block_tokens must be a static Python int, got float 2.0"),
    (lambda: te_jax_perm.make_row_id_map(_RM, block_tokens=True), TypeError,
     "block_tokens must be a static Python int, got bool True"),
    (lambda: te_jax_perm.make_row_id_map(_RM, block_tokens=2**40), ValueError,
     r"block_tokens must be <= 2147483647 \(int32 row indices\), got 1099511627776"),
    (lambda: te_jax_perm.make_row_id_map(_RM, single_pass="no"), TypeError,
     "single_pass must be a static Python bool, got str 'no'"),
    (lambda: te_jax_perm.make_row_id_map(_RM, 6, "xla"), TypeError,
     "make_row_id_map takes at most 2 positional arguments, got 3: block_tokens, single_pass and backend "
     "are keyword-only; pass backend='xla'"),
    (lambda: te_jax_perm.sort_chunks_by_map(X, jnp.arange(10, dtype=jnp.int32), None, "no"), TypeError,
     "is_forward must be a static Python bool, got str 'no'"),
    (lambda: te_jax_perm.sort_chunks_by_map(X, jnp.arange(10, dtype=jnp.int32), None, None), TypeError,
     "is_forward must be a static Python bool, got NoneType None"),
    (lambda: jax.jit(lambda f: te_jax_perm.sort_chunks_by_map(X, jnp.arange(10, dtype=jnp.int32), None, f))(False),
     TypeError, "is_forward must be a static Python bool, got DynamicJaxprTracer"),
    (lambda: te_jax_perm.sort_chunks_by_index_with_probs(X, [5, 5], [1, 0], None), TypeError,
     r"probs is None; expected float \[N\] probabilities"),
    (lambda: te_jax_perm.sort_chunks_by_index_with_probs(X, [5, 5], [1, 0], jnp.ones(10, jnp.float8_e4m3fn)),
     TypeError, "probs has dtype float8_e4m3fn; expected bfloat16, float16 or float32"),
    (lambda: te_jax_perm.routing_map_to_topk(np.bool_(True), 0), ValueError,
     r"routing_map has shape \(\) \(rank 0\); expected \[T, E\] or \[B, S, E\]"),
    (lambda: te_jax_perm.routing_map_to_topk(np.ones((4,), bool), 2), ValueError,
     r"routing_map has shape \(4,\) \(rank 1\); expected \[T, E\] or \[B, S, E\]"),
    (lambda: te_jax_perm.topk_to_routing_map(np.array([1, 3]), 4), ValueError,
     r"indices has shape \(2,\) \(rank 1\); expected \[T, k\] or \[B, S, k\]"),
    (lambda: te_jax_perm.routing_map_to_topk(np.zeros((8, 0), bool), 2), ValueError,
     r"k = 2 exceeds the routing map's E = 0 experts \(routing_map has shape \(8, 0\)\); expected k <= E"),
    (lambda: te_jax_perm.token_dispatch(None, _RM, 6), TypeError,
     "inp is NoneType None; expected an array"),
    (lambda: te_jax_perm.token_combine("abc", np.zeros((6, 9), np.int32)), TypeError,
     "inp is str 'abc'; expected an array"),
    (lambda: te_jax_perm.token_dispatch([[1.0, 2.0], [3.0]], np.eye(2, dtype=bool), 2), ValueError,
     r"inp is list \[\[1.0, 2.0\], \[3.0\]\], which makes no array .*; expected an array \(jax or NumPy\) or a "
     "nested list of numbers with one length per level"),
    (lambda: te_jax_perm.grouped_matmul(np.ones((6, 8)), np.ones((3, 8, 5)), None), TypeError,
     "group_sizes is NoneType None; expected an array"),
    (lambda: te_jax_perm.moe_ffn(np.ones((6, 8)), _RM, np.ones((6, 4)), None, _W_OUT, 6), TypeError,
     "w_in is NoneType None; expected an array"),
    (lambda: te_jax_perm.sort_chunks_by_map(X, None), TypeError,
     "row_id_map is NoneType None; expected an array"),
    (lambda: te_jax_perm.grouped_matmul(np.ones((6, 8)), np.ones((3, 8, 5)), [2, 2, 2], preferred_element_type="foo"),
     TypeError, "preferred_element_type='foo' is not a dtype"),
    (lambda: te_jax_perm.moe_ffn(np.ones((6, 8)), _RM, None, _W_IN, _W_OUT, 6), TypeError,
     r"probs is None; expected routing probabilities of shape \(6, 4\)"),
    (lambda: te_jax_perm.moe_ffn(np.ones((6, 8)), _RM, np.ones((6, 4)), _W_IN, _W_OUT, 6, activation=["silu"]),
     ValueError, r"activation=\['silu'\]; expected one of"),
], ids=["block_tokens_float", "block_tokens_bool", "block_tokens_huge", "single_pass_str", "make_row_id_map_backend",
        "is_forward_str", "is_forward_none", "is_forward_traced", "with_probs_none", "chunk_probs_fp8", "topk_rank0", "topk_rank1", "indices_rank1", "topk_k_past_e",
        "inp_none", "inp_str", "inp_ragged", "group_sizes_none", "w_in_none", "chunk_map_none",
        "preferred_element_type", "moe_ffn_probs_none", "moe_ffn_activation_list"])
def test_static_and_required_arguments_are_checked(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("call,message", [
    (lambda: te_jax_perm.sort_chunks_by_index(X, np.array([6, 6]), np.array([1, 0]))[0],
     r"sum\(split_sizes\) = 12 exceeds the 10 rows being sorted \(inp's rows, or make_chunk_sort_map's num_tokens\)"),
    (lambda: te_jax_perm.sort_chunks_by_index(X, [-1, 6], [1, 0])[0], "split_sizes has negative entries"),
    (lambda: te_jax_perm.make_chunk_sort_map(np.array([5, 5]), np.array([1, 1]), 10),
     r"sorted_indices = \[1, 1\] is not a permutation of range\(2\)"),
    (lambda: te_jax_perm.sort_chunks_by_map(X, np.array([2, 2, 0, 1, 3, 4, 5, 6, 7, 8], np.int32))[0],
     r"row_id_map names output rows \[2\] more than once"),
], ids=["sum_past_n", "negative_size", "not_a_permutation", "map_row_twice"])
def test_numpy_constants_under_jit_are_checked_as_concrete(monkeypatch, call, message):
    # Under jit, jnp.asarray makes a NumPy constant a tracer: the values must be checked before.
    monkeypatch.delenv("TE_JAX_PERM_CHECKS", raising=False)
    with pytest.raises(CheckError, match=message):
        jax.jit(call)()


@pytest.mark.parametrize("call,error,message", [
    (lambda: te_jax_perm.grouped_matmul(np.ones((6, 8)), np.ones((3, 8, 5)), np.array([2**32 + 2, 2, 2]),
                                          backend="xla"),
     ValueError, r"group_sizes = \[4294967298, 2, 2\] has entries outside int32"),
    # 2**32 + 1 would run as row 1
    (lambda: te_jax_perm.sort_chunks_by_map(X, np.array([2**32 + 1, 0, 2, 3, 4, 5, 6, 7, 8, 9], np.int64)),
     ValueError, "row_id_map = "),
], ids=["group_sizes", "chunk_sort_map"])
def test_int64_maps_and_group_sizes_are_checked_before_the_int32_cast(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_numpy_chunk_sort_map_may_be_any_integer_dtype_that_fits_int32():
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    order = np.arange(10)[::-1].copy()    # int64 on NumPy's default
    out, _ = te_jax_perm.sort_chunks_by_map(x, order, backend="xla")
    np.testing.assert_array_equal(np.asarray(out), x[::-1])
    with pytest.raises(TypeError, match="row_id_map has dtype float32; expected an integer dtype"):
        te_jax_perm.sort_chunks_by_map(x, order.astype(np.float32), backend="xla")


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_batched_inputs_with_an_empty_last_axis_flatten(backend):
    """[B, S, 0] tokens, routing maps and probabilities are [B*S, 0] (a reshape to (-1, 0)
    cannot infer its rows)."""
    rm = np.zeros((2, 4, 4), bool)
    rm[..., :2] = True
    out, _, rid, _, _ = te_jax_perm.token_dispatch(np.zeros((2, 4, 0), np.float32), rm, 16, backend=backend)
    assert out.shape == (16, 0) and rid.shape == (8, 9)
    out, pp, rid, _, _ = te_jax_perm.token_dispatch(np.ones((2, 4, 3), np.float32), np.zeros((2, 4, 0), bool), 4,
                                                    probs=np.zeros((2, 4, 0), np.float32), backend=backend)
    assert out.shape == (4, 3) and pp.shape == (4,) and rid.shape == (8, 1)
    np.testing.assert_array_equal(np.asarray(out), 0)
    combined = te_jax_perm.token_combine(out, rid, merging_probs=np.zeros((2, 4, 0), np.float32), backend=backend)
    np.testing.assert_array_equal(np.asarray(combined), np.zeros((8, 3)))
    sorted_rows, _ = te_jax_perm.sort_chunks_by_index(np.zeros((2, 4, 0), np.float32), [8], [0], backend=backend)
    assert sorted_rows.shape == (8, 0)


def test_symbolic_shapes_are_refused_by_argument():
    """jax.export's symbolic shapes reach the kernel declarations, whose sizes set grids,
    tiles and buffer lengths: refused naming the kernel argument, not JAX's error about an
    inconclusive dimension."""
    from jax import export
    f = jax.jit(lambda x, rm: te_jax_perm.token_dispatch(x, rm, 16, backend="xla")[0])
    x = jax.ShapeDtypeStruct(export.symbolic_shape("8, h"), jnp.float32)
    with pytest.raises(TypeError, match=r"argument 'inp' has shape \(8, h\) with symbolic sizes"):
        export.export(f)(x, jax.ShapeDtypeStruct((8, 4), jnp.bool_))
    # Concrete shapes export.
    exported = export.export(f)(jax.ShapeDtypeStruct((8, 3), jnp.float32), jax.ShapeDtypeStruct((8, 4), jnp.bool_))
    assert exported.out_avals[0].shape == (16, 3)


_BAD_PADS = {
    # A negative offset puts an expert's rows on an earlier expert's rows or before row 0.
    "negative": ([0, -1, 0, 0], 14, r"pad_offsets = \[0, -1, 0, 0\] has negative entries; expected rows of "
                 r"padding before each expert"),
    # Experts' unpadded rows sit back to back: an offset below the one before moves the
    # expert's rows onto the previous expert's rows.
    "decreasing": ([0, 3, 1, 1], 20, r"pad_offsets = \[0, 3, 1, 1\] decreases at expert 2 \(3 then 1\); expected "
                   r"rows of padding before each expert, all >= 0 and non-decreasing"),
}


@pytest.mark.parametrize("bad", sorted(_BAD_PADS))
@pytest.mark.parametrize("op", ["permute", "unpermute"])
def test_pad_offsets_that_would_lose_rows_raise(monkeypatch, op, bad):
    pad, n, message = _BAD_PADS[bad]
    rid, kept = te_jax_perm.make_row_id_map(_RM, backend="xla")
    x, rows = np.ones((6, 8), np.float32), np.ones((n, 8), np.float32)
    call = ((lambda pad: te_jax_perm.permute_with_mask_map(x, rid, kept, n, None, pad, backend="xla")[0])
            if op == "permute" else
            (lambda pad: te_jax_perm.unpermute_with_mask_map(rows, rid, None, pad, backend="xla")))
    for given in (np.array(pad, np.int32), pad):
        with pytest.raises(CheckError, match=message):
            call(given)
    with pytest.raises(CheckError, match=message):   # a NumPy constant under jit is concrete
        jax.jit(lambda: call(np.array(pad, np.int32)))()
    monkeypatch.setenv("TE_JAX_PERM_CHECKS", "1")
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(call)(jnp.array(pad, jnp.int32)))
    assert call(np.array([0, 2, 2, 4], np.int32)).shape[1] == 8


@pytest.mark.parametrize("devices", [None, [], [1, 2], "cpu"], ids=["none", "empty", "ints", "str"])
def test_ragged_all_to_all_supported_names_what_it_cannot_probe(devices):
    from te_jax_perm.parallel.a2a_support import ragged_all_to_all_supported
    with pytest.raises(TypeError, match=r"ragged_all_to_all_supported: devices is \w+ .*; expected a non-empty "
                                        r"sequence of jax.Device"):
        ragged_all_to_all_supported(devices)


def _tune(shapes, options=None):
    from te_jax_perm.ops.chunk_sort import decl as chunk_decl
    return te_jax_perm.autotune.tune(chunk_decl.sort_chunks, shapes, {}, "interpret",
                                     *(() if options is None else (options,)))


@pytest.mark.parametrize("call,error,message", [
    # A string, None or an array would be read by its truth value: "off" turned tuning on.
    (lambda: te_jax_perm.autotune.autotuning("off").__enter__(), TypeError,
     r"^autotuning: on must be a static Python bool, got str 'off'$"),
    (lambda: te_jax_perm.autotune.enable("off"), TypeError, r"^enable: on must be a static Python bool, got str 'off'$"),
    (lambda: te_jax_perm.autotune.enable(None), TypeError, r"^enable: on must be a static Python bool, got NoneType None$"),
    (lambda: te_jax_perm.sanitize.sanitize("no").__enter__(), TypeError,
     r"^sanitize: raise_on_first must be a static Python bool, got str 'no'$"),
    (lambda: te_jax_perm.sanitize.check(lambda: None, raise_on_first=None), TypeError,
     r"^sanitize: raise_on_first must be a static Python bool, got NoneType None$"),
    # Stored as given, a dict failed inside a later tuning naming no argument.
    (lambda: te_jax_perm.autotune.enable(True, {"reps": 1}), TypeError,
     r"^options is dict \{'reps': 1\}; expected a te_jax_perm.autotune.TuneOptions$"),
    (lambda: _tune([((6, 8), np.uint32), ((6,), np.int32)], {"reps": 1}), TypeError,
     r"^options is dict \{'reps': 1\}; expected a te_jax_perm.autotune.TuneOptions$"),
    (lambda: _tune([(6, 8)]), TypeError,
     r"^tune: shapes\[0\] is \(6, 8\); expected an array, a jax.ShapeDtypeStruct or a \(shape, dtype\) pair"),
    (lambda: te_jax_perm.autotune.TuneOptions(reps=1.5), TypeError,
     r"^TuneOptions.reps must be a static Python int, got float 1.5$"),
    (lambda: te_jax_perm.autotune.TuneOptions(max_candidates=-1), ValueError,
     r"^TuneOptions.max_candidates must be >= 0, got -1$"),
    (lambda: te_jax_perm.autotune.set_cache_dir(3), TypeError,
     r"^path is int 3; expected a directory \(str or os.PathLike\), or None"),
    # NumPy reads an array as its dtype: the result dtype was set by an array's.
    (lambda: te_jax_perm.grouped_matmul(np.ones((6, 8)), np.ones((3, 8, 5)), [2, 2, 2],
                                        preferred_element_type=jnp.zeros(3)), TypeError,
     r"^preferred_element_type is ArrayImpl of shape \(3,\), not a dtype; expected e.g. jnp.float32 or None$"),
], ids=["autotuning_str", "enable_str", "enable_none", "sanitize_str", "check_none", "enable_options_dict",
        "tune_options_dict", "tune_bare_shape", "tune_options_reps_float", "tune_options_cap_negative",
        "set_cache_dir_int", "preferred_element_type_array"])
def test_switches_options_and_dtypes_are_checked_as_given(call, error, message):
    before = te_jax_perm.autotune.enabled()
    with pytest.raises(error, match=message):
        call()
    assert te_jax_perm.autotune.enabled() is before   # a refused switch changes nothing
