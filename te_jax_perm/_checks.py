"""Argument checks shared by every op, so that each error reads the same way.

Every message names the argument, the shape (or dtype/value) seen and what was expected.
Values are checked through :func:`te_jax_perm.core.checks.check_values`: concrete ones at
once, traced ones when the program runs under ``TE_JAX_PERM_CHECKS=1``.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from te_jax_perm.core.checks import check_values, concrete
from te_jax_perm.core.env import BACKEND_VALUES

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1


def _shown(values: np.ndarray, limit: int = 16) -> str:
    flat = values.ravel().tolist()
    return f"{flat[:limit]}{'...' if len(flat) > limit else ''}"


def keyword_only(fn: Callable | None = None, *, backends: Sequence[str] = BACKEND_VALUES) -> Callable:
    """``fn`` naming its keyword-only parameters when it gets too many positional arguments
    (Python's own error counts them and names none), and, when the extra one is the name of
    one of ``backends`` (what ``fn``'s ``backend=`` takes), the ``backend=`` to pass instead.
    Used bare (``@keyword_only``) or with the backends of an op that takes more names."""
    if fn is None:
        return functools.partial(keyword_only, backends=backends)
    params = inspect.signature(fn).parameters.values()
    most = sum(p.kind == p.POSITIONAL_OR_KEYWORD for p in params)
    names = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    named = f"{', '.join(names[:-1])} and {names[-1]} are" if len(names) > 1 else f"{names[0]} is"

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        if len(args) > most:
            extra = args[most]
            hint = (f"; pass backend={extra!r}" if "backend" in names and isinstance(extra, str)
                    and extra.lower() in backends else "")
            raise TypeError(f"{fn.__name__} takes at most {most} positional arguments, got {len(args)}: "
                            f"{named} keyword-only{hint}")
        return fn(*args, **kwargs)
    return checked


def array_like(name: str, x: Any) -> Any:
    """``x`` itself when it is an array (jax or NumPy), else ``np.asarray(x)``: no cast yet.
    ``None``, text, ragged lists and other objects that make no array of numbers raise,
    naming ``name``."""
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return x
    try:
        a = np.asarray(x) if x is not None else None
    except ValueError as e:   # a ragged nested list: NumPy's message names no argument
        raise ValueError(f"{name} is {type(x).__name__} {x!r:.60}, which makes no array ({e}); expected an array "
                         "(jax or NumPy) or a nested list of numbers with one length per level") from None
    if a is None or a.dtype.kind in "OUSV":
        raise TypeError(f"{name} is {type(x).__name__} {x!r:.60}; expected an array (jax or NumPy) or a nested "
                        "list of numbers")
    return a


def array(name: str, x: Any) -> jax.Array:
    """``x`` as a jax array (see :func:`array_like`)."""
    return jnp.asarray(array_like(name, x))


def _dt(x: Any) -> np.dtype:
    return np.dtype(jnp.asarray(x).dtype) if not hasattr(x, "dtype") else np.dtype(x.dtype)


def check_rank(name: str, x: Any, ranks: Sequence[int], expected: str) -> None:
    if x.ndim not in ranks:
        raise ValueError(f"{name} has shape {tuple(x.shape)} (rank {x.ndim}); expected {expected}")


def flatten_rows(name: str, x: Any, rows: str, last: str) -> Any:
    """``x`` of shape ``[rows, last]``, or ``[B, S, last]`` flattened to ``B*S`` rows."""
    check_rank(name, x, (2, 3), f"[{rows}, {last}] or [B, S, {last}]")
    # Rows counted, not inferred: a -1 cannot be inferred when the last axis is empty.
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2]) if x.ndim == 3 else x


def check_shape(name: str, x: Any, shape: tuple[int, ...], expected: str | None = None) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {expected or tuple(shape)}")


def check_probs_dtype(name: str, x: Any) -> None:
    if _dt(x).name not in ("bfloat16", "float16", "float32"):
        raise TypeError(f"{name} has dtype {_dt(x).name}; expected bfloat16, float16 or float32")


def check_int32(name: str, x: Any) -> None:
    if _dt(x) != np.int32:
        raise TypeError(f"{name} has dtype {_dt(x).name}; expected int32")


def check_token_dtype(name: str, x: Any) -> None:
    dt = _dt(x)
    if not (jnp.issubdtype(dt, jnp.floating) or dt.name.startswith("float8")):  # np misses bfloat16
        raise TypeError(f"{name} has dtype {dt.name}; expected a floating dtype "
                        "(bfloat16, float16, float32 or a float8 dtype)")


def check_routing_dtype(name: str, x: Any) -> None:
    dt = _dt(x)
    if not (dt == np.bool_ or np.issubdtype(dt, np.integer)):
        hint = (f" (a 0/1 float map: pass {name}.astype(bool); probabilities: probs > 0)"
                if np.issubdtype(dt, np.floating) else "")
        raise TypeError(f"{name} has dtype {dt.name}; expected bool or an integer dtype holding 0/1{hint}")


def routing_map_array(name: str, x: Any) -> jax.Array:
    """``x`` as a routing map array: bool, or integers that are all 0 or 1 (checked before
    any cast, at once when concrete)."""
    x = array_like(name, x)
    check_routing_dtype(name, x)
    if _dt(x) != np.bool_:
        check_values(functools.partial(_not_zero_one, name), x)
    arr = jnp.asarray(x)
    if isinstance(arr, jax.core.Tracer) and not isinstance(x, jax.core.Tracer):
        # A concrete map closed over by a traced function: behind a barrier, XLA does not
        # build the row-id map from it at compile time (on the xla backend a minute for a
        # 4096 x 256 map, where the device takes microseconds). The barrier costs nothing.
        arr = jax.lax.optimization_barrier(arr)
    return arr


def _not_zero_one(name: str, m: np.ndarray) -> str | None:
    bad = m[(m != 0) & (m != 1)]
    if not bad.size:
        return None
    return (f"{name} holds values other than 0 and 1 (e.g. {_shown(np.unique(bad), 8)}); expected a routing "
            f"map [T, E] of 0/1 or bool. Top-k expert indices [T, k] are not a routing map: convert them with "
            f"te_jax_perm.topk_to_routing_map(indices, num_experts)")


def routing_rows(routing_map: Any, tokens_name: str, tokens: Any) -> Any:
    """``routing_map`` flattened to ``[T, E]``, checked to route the tokens of ``tokens``
    (the op's argument ``tokens_name``, ``[T, H]`` or ``[B, S, H]``)."""
    rm = flatten_rows("routing_map", routing_map, "T", "E")
    if rm.shape[0] != (rows := math.prod(tokens.shape[:-1])) or (
            routing_map.ndim == tokens.ndim == 3 and routing_map.shape[:2] != tokens.shape[:2]):
        raise ValueError(f"routing_map has shape {tuple(routing_map.shape)}; expected {rows} tokens like "
                         f"{tokens_name} {tuple(tokens.shape)} (i.e. {tuple(tokens.shape[:-1]) + ('E',)})")
    return rm


def probs_like_map(probs: Any, routing_map: Any) -> jax.Array:
    """``probs`` as an array of ``routing_map``'s shape and a probability dtype, flattened
    to ``[T, E]`` as the map is."""
    if probs is None:
        raise TypeError(f"probs is None; expected routing probabilities of shape {tuple(routing_map.shape)} "
                        "(the routing_map shape)")
    probs = array("probs", probs)
    if tuple(probs.shape) != tuple(routing_map.shape):
        raise ValueError(f"probs has shape {tuple(probs.shape)}; expected {tuple(routing_map.shape)} "
                         "(the routing_map shape)")
    check_probs_dtype("probs", probs)
    return probs.reshape(math.prod(routing_map.shape[:-1]), routing_map.shape[-1])


def check_index_values(name: str, x: Any) -> None:
    """``x`` has an integer dtype and, when concrete, values that fit int32 (the ops cast
    to int32: a concrete 2**32 + 3 must fail here, not run as 3)."""
    if not jnp.issubdtype(_dt(x), jnp.integer):
        raise TypeError(f"{name} has dtype {_dt(x).name}; expected an integer dtype")
    values = concrete(x)
    if values is not None and values.size and (values.min() < INT32_MIN or values.max() > INT32_MAX):
        raise ValueError(f"{name} = {_shown(values)} has entries outside int32 [-2**31, 2**31); expected "
                         "values that fit int32")


def index_vector(name: str, x: Any) -> Any:
    """``x`` as an int32 vector ``[C]`` (chunk sizes, chunk orders), checked before the cast."""
    x = array_like(name, x)
    check_rank(name, x, (1,), "rank 1 [C]")
    check_index_values(name, x)
    # NumPy values stay NumPy: under jit, jnp.asarray makes even a constant a tracer, and
    # the ops' checks of concrete values (a permutation, sizes within N) would not see it.
    return x.astype(np.int32) if isinstance(x, np.ndarray) else jnp.asarray(x).astype(jnp.int32)


def pad_offsets_problem(pad_offsets: np.ndarray) -> str | None:
    """Why ``pad_offsets`` [E] cannot pad an unpadded map, or ``None``. Expert ``e``'s rows
    land at their unpadded rows plus ``pad_offsets[e]``; the unpadded experts sit back to
    back, so an offset below the previous expert's (a negative one is below the 0 before
    expert 0) puts rows on that expert's rows or before row 0, and those rows are lost."""
    if (pad_offsets < 0).any():
        return f"pad_offsets = {_shown(pad_offsets)} has negative entries; expected rows of padding before each " \
               "expert, all >= 0 and non-decreasing"
    if (falls := np.argwhere(np.diff(pad_offsets, axis=-1) < 0)).size:
        *row, e = falls[0]   # the first fall; a vmapped check sees rows of offsets
        prev, at = pad_offsets[(*row, e)], pad_offsets[(*row, e + 1)]
        return (f"pad_offsets = {_shown(pad_offsets)} decreases at expert {e + 1} ({prev} then {at}); expected "
                "rows of padding before each expert, all >= 0 and non-decreasing (a cumulative sum, as "
                "token_dispatch returns them)")
    return None


def check_static_int(name: str, v: Any, minimum: int) -> int:
    """``v`` as a Python int in ``[minimum, INT32_MAX]``: every row index and count the
    kernels use is int32."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be a static Python int, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    if v > INT32_MAX:
        raise ValueError(f"{name} must be <= {INT32_MAX} (int32 row indices), got {v}")
    return int(v)


def check_static_bool(name: str, v: Any) -> bool:
    """``v`` as a Python bool: a string, ``None`` or a traced flag would otherwise be read
    by its truth value."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be a static Python bool, got {type(v).__name__} {v!r}")
    return bool(v)


def num_experts_of_map(row_id_map: Any) -> int:
    """E from a row-id map of shape [T, 2E+1], with a clear error otherwise."""
    if not hasattr(row_id_map, "ndim"):
        raise TypeError(f"row_id_map is a {type(row_id_map).__name__}; expected an int32 array [T, 2*E+1] "
                        "as returned by token_dispatch or make_row_id_map")
    if row_id_map.ndim != 2 or row_id_map.shape[1] % 2 != 1:
        raise ValueError(f"row_id_map has shape {tuple(row_id_map.shape)}; expected [T, 2*E+1] "
                         "as returned by make_row_id_map")
    check_int32("row_id_map", row_id_map)
    return (row_id_map.shape[1] - 1) // 2


def row_id_map_problem(rows: int, rid: np.ndarray, pad_offsets: np.ndarray | None = None) -> str | None:
    """Why the row-id map ``rid`` [T, 2E+1] cannot address an input of ``rows`` rows (as
    ``token_combine`` reads it, with ``pad_offsets`` when given), or ``None``."""
    e = (rid.shape[1] - 1) // 2
    counts = rid[:, 2 * e]
    if ((counts < 0) | (counts > e)).any():
        return f"row_id_map has routed counts {_shown(np.unique(counts[(counts < 0) | (counts > e)]), 8)} " \
               f"(last column); expected counts in [0, E={e}]"
    used = np.arange(e)[None, :] < counts[:, None]
    experts, dest = rid[:, e:2 * e][used], rid[:, :e][used]
    if ((experts < 0) | (experts >= e)).any():
        return f"row_id_map has expert ids {_shown(np.unique(experts[(experts < 0) | (experts >= e)]), 8)}; " \
               f"expected ids in [0, E={e})"
    bad = dest[(dest < -1) | (dest >= rows)]
    if bad.size:
        return (f"row_id_map addresses rows {_shown(np.unique(bad), 8)}, but inp has {rows} rows; expected "
                f"destinations in [-1, {rows}): is it the map of the dispatch whose output inp is?")
    if pad_offsets is not None:
        shifted, packed = _padding_layout(rid, pad_offsets)
        if shifted and packed:
            return ("row_id_map holds unpadded destinations (its rows are packed from 0), but pad_offsets = "
                    f"{_shown(pad_offsets)} pads experts that have rows; expected the row_id_map of the padded "
                    "token_dispatch that returned these pad_offsets (it addresses the padded rows), or no "
                    "pad_offsets with an unpadded map")
    return None


def _padding_layout(rid: np.ndarray, pad_offsets: np.ndarray) -> tuple[bool, bool]:
    """``(shifted, packed)`` of the map ``rid`` [T, 2E+1]: whether ``pad_offsets`` pads an
    expert that has kept rows, and whether the kept rows are packed from row 0 (an unpadded
    map's are; a padded map's leave the padding's gaps). Entries past a token's count (clamped
    to ``[0, E]``), with an expert outside ``[0, E)`` or a negative destination are not kept."""
    e = (rid.shape[1] - 1) // 2
    counts = np.clip(rid[:, 2 * e], 0, e)
    used = np.arange(e)[None, :] < counts[:, None]
    experts, dest = rid[:, e:2 * e][used], rid[:, :e][used]
    kept = (dest >= 0) & (experts >= 0) & (experts < e)
    shifted = bool((pad_offsets[experts[kept]] != 0).any())
    return shifted, np.array_equal(np.sort(dest[kept]), np.arange(int(kept.sum())))


def padded_twice_problem(rid: np.ndarray, pad_offsets: np.ndarray) -> str | None:
    """Why ``pad_offsets`` must not be applied to ``rid`` [T, 2E+1] (as the lower-level ops
    apply it, to the unpadded map of :func:`make_row_id_map`), or ``None``. A map whose kept
    rows leave gaps already addresses padded rows (``token_dispatch``'s map does): padding it
    again would move every row of a padded expert onto another expert's rows."""
    shifted, packed = _padding_layout(rid, pad_offsets)
    if not shifted or packed:
        return None
    return ("row_id_map already addresses padded rows (its kept rows leave gaps, as the map token_dispatch "
            f"returns does), and pad_offsets = {_shown(pad_offsets)} would pad them a second time; expected "
            "make_row_id_map's unpadded map with pad_offsets, or token_dispatch's map without pad_offsets")


def first_order(name: str, fn: Callable) -> Callable:
    """``fn`` with a derivative rule that refuses by name. The ops' gradients are custom VJPs
    whose forward and backward passes run kernels on bit views of the rows, or kernels with
    no derivative rule of their own: differentiated again, the bit views would pass on zero
    derivatives without a word (JAX does not differentiate integers), and a kernel's missing
    rule would raise an error naming neither the op nor why. Wrap every call whose inputs a
    second differentiation can reach (an op's forward rule and backward rule)."""
    wrapped = jax.custom_jvp(fn)

    @wrapped.defjvp
    def _refuse(primals, tangents):
        raise NotImplementedError(
            f"{name}: the te_jax_perm ops have first-order gradients (custom VJPs); differentiating one of their "
            "gradients again (jax.grad of jax.grad, jax.hessian, a JVP through a VJP) is not supported")
    return wrapped
