"""Whether ``jax.lax.ragged_all_to_all`` runs on a platform, found out once by trying it.

XLA:CPU (jax 0.10) rejects the op at compile time ("HLO opcode `ragged-all-to-all` is not
supported by XLA:CPU ThunkEmitter"); XLA:GPU implements it. Rather than keep a table of
versions, the probe compiles and runs a tiny exchange on the devices in question and checks
its result, and the answer is cached per (platform, device kind, device count).
"""
from __future__ import annotations

import threading
from typing import Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from te_jax_perm.parallel.exchange import ragged_output


def ragged_all_to_all_supported(devices: Sequence[jax.Device]) -> bool:
    """True when a ragged all-to-all over ``devices`` compiles and gives the right result."""
    given = devices
    try:
        devices = tuple(devices)
    except TypeError:
        devices = ()
    if not devices or not all(hasattr(d, "platform") for d in devices):   # jax.Device, or alike
        raise TypeError(f"ragged_all_to_all_supported: devices is {type(given).__name__} {given!r:.80}; expected "
                        "a non-empty sequence of jax.Device (e.g. tuple(mesh.devices.flat))")
    key = (devices[0].platform, getattr(devices[0], "device_kind", ""), len(devices))
    # One probe per key, however many threads ask at once; the answer is returned from
    # here, not read back, so a forget_probes() in another thread cannot take it away.
    with _lock:
        known = _cache.get(key)
        if known is None:
            known = _cache[key] = probe(devices)
            logging.info("ragged_all_to_all on %s (%s) x%d: %s", *key,
                         "supported" if known else "not supported, using the dense all_to_all")
    return known


_cache: dict[tuple, bool] = {}
_lock = threading.Lock()


def forget_probes() -> None:
    """Drops the cached answers of :func:`ragged_all_to_all_supported` (one per platform,
    device kind and device count), e.g. after ``jax.lax.ragged_all_to_all`` was replaced."""
    with _lock:
        _cache.clear()


def probe(devices: tuple) -> bool:
    """Runs the check once, uncached: a ragged all-to-all over ``devices`` gives the right rows."""
    n = len(devices)
    mesh = Mesh(np.array(devices), ("probe",))

    def body(x):
        # Rank r sends its rows [0, d+1) to rank d, placed there at rows [r*n, r*n + d + 1).
        me = jax.lax.axis_index("probe")
        sizes = jnp.arange(1, n + 1, dtype=jnp.int32)
        out = ragged_output((n * n, 1), x)     # typed as the layer's exchange types it
        return jax.lax.ragged_all_to_all(x, out, jnp.zeros((n,), jnp.int32), sizes,
                                         jnp.full((n,), me * n, jnp.int32),
                                         jnp.full((n,), me + 1, jnp.int32), axis_name="probe")

    x = np.tile(np.arange(n, dtype=np.float32)[:, None], (n, 1)) + 100 * np.repeat(
        np.arange(n, dtype=np.float32), n)[:, None]            # rank r's row i = 100 r + i
    try:
        # Compiled ahead of time and called as an executable: this also runs for real when
        # first asked while tracing a jitted caller (ep_moe_layer with a2a="auto").
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("probe"), out_specs=P("probe")))
        compiled = fn.lower(jax.ShapeDtypeStruct(x.shape, x.dtype)).compile()
        got = np.asarray(compiled(x)).reshape(n, n, n)         # [dst, src, slot]
    except Exception as e:  # noqa: BLE001 - any failure to compile or run means "unsupported"
        logging.info("ragged_all_to_all probe failed: %s", str(e).splitlines()[0] if str(e) else type(e))
        return False
    slot = np.arange(n)
    want = np.where(slot[None, None, :] <= np.arange(n)[:, None, None],
                    100.0 * np.arange(n)[None, :, None] + slot[None, None, :], 0.0)
    ok = bool(np.array_equal(got, want))
    if not ok:
        logging.warning("ragged_all_to_all probe ran but returned a wrong result; not using it")
    return ok


def resolve_a2a(mode: str, devices: Sequence[jax.Device]) -> str:
    """``"dense"`` or ``"ragged"``: the exchange the expert-parallel layer runs over
    ``devices`` for ``EPConfig.a2a = mode``.

    ``"auto"`` is ``"ragged"`` where :func:`ragged_all_to_all_supported` finds it runs on
    ``devices``, else ``"dense"``; ``"ragged"`` on devices without it raises here, where XLA
    would refuse it only when compiling the program.

    Raises:
      ValueError: ``mode`` is not ``"dense"``, ``"ragged"`` or ``"auto"``, or is
        ``"ragged"`` where ``devices`` cannot run a ragged all-to-all.
    """
    if mode not in ("dense", "ragged", "auto"):
        raise ValueError(f"EPConfig.a2a = {mode!r}; expected 'dense', 'ragged' or 'auto'")
    if mode == "dense":
        return mode
    devices = tuple(devices)
    supported = ragged_all_to_all_supported(devices)
    if mode == "ragged" and not supported:
        raise ValueError(f"EPConfig.a2a = 'ragged', but ragged_all_to_all does not run on these "
                         f"{devices[0].platform} devices; expected 'auto' (ragged where it runs) or 'dense'")
    return "ragged" if supported else "dense"
