"""Whether ``jax.lax.ragged_all_to_all`` runs on a platform, found out once by trying it.

XLA:CPU (jax 0.10) rejects the op at compile time ("HLO opcode `ragged-all-to-all` is not
supported by XLA:CPU ThunkEmitter"); XLA:GPU implements it. Rather than keep a table of
versions, the probe compiles and runs a tiny exchange on the devices in question, the
layer's own, and checks its rows and its gradient; the answer is cached per (platform,
device kind, device count).
"""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from te_jax_perm.parallel.exchange import ragged_slices, send_rows


def ragged_all_to_all_supported(devices: Sequence[jax.Device]) -> bool:
    """True when a ragged all-to-all over ``devices`` compiles and gives the right rows and
    gradient."""
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
    """Runs the check once, uncached: the layer's ragged exchange over ``devices`` delivers
    the right rows, and its gradient brings each device's own cotangent home.

    It runs in a thread of its own: JAX's mesh context (``jax.set_mesh``, or the mesh of a
    ``shard_map`` whose body is being traced) and its trace state belong to the calling
    thread, and the probe's program, over a mesh of its own, must see neither."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="te_jax_perm_ragged_probe") as worker:
        return worker.submit(_probe, devices).result()     # its exception, if any, raised here


def _probe(devices: tuple) -> bool:
    n = len(devices)
    mesh = Mesh(np.array(devices), ("probe",))
    # Rank r sends d + 1 rows to rank d, from its rows start[d] .. start[d] + d (chunks side
    # by side, as the layer's are), placed there at rows r*n .. r*n + d.
    sizes = np.arange(1, n + 1, dtype=np.int32)
    start = (np.cumsum(sizes) - sizes).astype(np.int32)
    m = int(sizes.sum())
    slices = ragged_slices(devices)   # as the layer slices them over these devices

    def body(x, ct):
        sent = jnp.asarray(sizes)
        recv = jax.lax.all_to_all(sent, "probe", 0, 0, tiled=True)
        y, vjp = jax.vjp(lambda x: send_rows(x, jnp.asarray(start), sent, recv, n, "probe", "ragged", slices), x)
        return y, vjp(ct)[0]

    # Every value distinct and exact in float32: rank r's row i is 1000 r + i; the cotangent
    # of rank d's row q is 1000 d + q + 0.5 (different on every device, as a loss's is).
    x = (1000 * np.arange(n, dtype=np.float32)[:, None] + np.arange(m, dtype=np.float32)[None, :]).reshape(-1, 1)
    ct = (1000 * np.arange(n, dtype=np.float32)[:, None] + np.arange(n * n, dtype=np.float32)[None, :]
          + 0.5).reshape(-1, 1)
    try:
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("probe"), P("probe")),
                                   out_specs=(P("probe"), P("probe"))))
        got, grad = (np.asarray(a).reshape(n, -1) for a in fn(x, ct))
    except Exception as e:  # noqa: BLE001 - any failure to compile or run means "unsupported"
        logging.info("ragged_all_to_all probe failed: %s", str(e).splitlines()[0] if str(e) else type(e))
        return False
    x, ct = x.reshape(n, m), ct.reshape(n, n * n)
    want, want_grad = np.zeros_like(ct), np.zeros_like(x)
    for r in range(n):
        for d in range(n):
            want[d, r * n:r * n + d + 1] = x[r, start[d]:start[d] + d + 1]
            want_grad[r, start[d]:start[d] + d + 1] = ct[d, r * n:r * n + d + 1]
    for what, g, w in (("rows", got, want), ("gradient", grad, want_grad)):
        if not np.array_equal(g, w):
            logging.warning("ragged_all_to_all probe ran but returned a wrong %s; not using it", what)
            return False
    return True


def resolve_a2a(mode: str, devices: Sequence[jax.Device]) -> str:
    """``"dense"`` or ``"ragged"``: the exchange the expert-parallel layer runs over
    ``devices`` for ``EPConfig.a2a = mode``.

    ``"auto"`` is ``"ragged"`` where :func:`ragged_all_to_all_supported` finds it runs on
    ``devices``, else ``"dense"``; ``"ragged"`` on devices without it raises here, where XLA
    would refuse it only when compiling the program.

    Where JAX runs several processes, every process must build the same exchange, and a
    probe could not run on other processes' devices, nor be sure to find the same answer
    in each: there ``"auto"`` is ``"dense"`` and ``"ragged"`` is taken as asked, unprobed.

    Raises:
      ValueError: ``mode`` is not ``"dense"``, ``"ragged"`` or ``"auto"``, or is
        ``"ragged"`` where ``devices`` cannot run a ragged all-to-all.
    """
    if mode not in ("dense", "ragged", "auto"):
        raise ValueError(f"EPConfig.a2a = {mode!r}; expected 'dense', 'ragged' or 'auto'")
    if mode == "dense":
        return mode
    if jax.process_count() > 1:
        return "ragged" if mode == "ragged" else "dense"
    devices = tuple(devices)
    supported = ragged_all_to_all_supported(devices)
    if mode == "ragged" and not supported:
        raise ValueError(f"EPConfig.a2a = 'ragged', but ragged_all_to_all does not run on these "
                         f"{devices[0].platform} devices; expected 'auto' (ragged where it runs) or 'dense'")
    return "ragged" if supported else "dense"
