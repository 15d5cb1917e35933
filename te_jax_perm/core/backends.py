"""Backend selection: ``triton`` (GPU), ``interpret`` (CPU, Triton interpreter), ``xla``.

Precedence: the ``backend=`` keyword of an op, then the innermost :func:`use_backend`
context, then the ``TE_JAX_PERM_BACKEND`` environment variable, then the platform
default (``triton`` where computations are placed on a GPU, else ``xla``: JAX's default
device where ``jax.default_device`` sets one, else its default backend; a caller that knows
where its computation is placed, as the expert-parallel layer knows its mesh, passes that
platform instead).

A :func:`use_backend` block is part of the cache key of ``jax.jit``: a jitted function
called in a block naming another backend than the one it was traced with is traced again,
and runs the backend asked for. It holds for the thread that opens it; threads started
inside it (``asyncio.to_thread`` workers too) do not inherit it, and start outside any
block. As with JAX's own configuration blocks, leaving a block restores the value it
replaced: asyncio tasks share their thread's block, so a block held open across an
``await`` while another task opens and closes its own is left out of order; pass
``backend=`` to ops in such code. ``TE_JAX_PERM_BACKEND`` is a process-level setting,
read when an op is traced: a function jitted before it changes keeps the backend it was
traced with.
"""
from __future__ import annotations

import contextlib
import importlib.util
from typing import Iterator

import jax

from te_jax_perm.core import env

BACKENDS = env.BACKEND_VALUES

# The innermost use_backend() block's backend, None outside any: a JAX user context, whose
# value jax.jit keys its tracing, lowering and compilation caches on. Entering a block sets
# it for the calling thread only (JAX keeps context values per thread).
_scope = jax.make_user_context(None)


class BackendUnavailableError(RuntimeError):
    """Raised when a requested backend cannot run here; says what is missing."""


def check_backend_name(name: str, names: tuple[str, ...] = BACKENDS, what: str = "backend",
                       optional: bool = False) -> str:
    """``name`` as one of ``names`` (lower case); case does not matter, as in
    ``TE_JAX_PERM_BACKEND``. Errors name ``what`` (the argument or field) and, where
    ``optional``, say ``None`` is taken too (the caller handles it)."""
    expected = f"expected one of {names}" + (" or None" if optional else "")
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a string, got {type(name).__name__} {name!r}; {expected}")
    if name.lower() not in names:
        raise ValueError(f"unknown {what}={name!r}; {expected}")
    return name.lower()


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Context manager selecting the default backend for ops traced inside it, in the
    calling thread; yields the name (lower case). A jitted function called inside is traced
    again where it was traced for another backend: ``jax.jit`` keys its cache on the block."""
    name = check_backend_name(name)
    with _scope(name):
        yield name


def default_platform() -> str:
    """Where JAX places a computation that names no device: the platform of the
    ``jax.default_device`` setting where one is in effect (a ``with jax.default_device(cpu):``
    block on a GPU machine, say), else JAX's default backend; GPUs read ``"gpu"``."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    platform = (device if isinstance(device, str) else device.platform).lower()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def device_kind() -> str:
    """The kind of the device this process computes on (JAX's first device), e.g.
    ``"NVIDIA H100 80GB HBM3"``: the key of tuned configs, shipped or cached."""
    return jax.devices()[0].device_kind


def default_backend(platform: str | None = None) -> str:
    """``TE_JAX_PERM_BACKEND``, else the default for devices of ``platform`` (a JAX device
    platform such as ``"gpu"`` or ``"cpu"``; ``None``: :func:`default_platform`)."""
    return env.backend() or ("triton" if (platform or default_platform()) == "gpu" else "xla")


def resolve_backend(name: str | None = None, platform: str | None = None) -> str:
    """The backend an op call will use; raises if it is not available here. ``platform``:
    where the computation is placed, when the caller knows it (see :func:`default_backend`)."""
    chosen = check_backend_name(name) if name is not None else (_scope.value or default_backend(platform))
    ensure_available(chosen)
    return chosen


def ensure_available(name: str) -> None:
    if name == "triton":
        if jax.default_backend() != "gpu":
            raise BackendUnavailableError(
                "backend 'triton' needs a CUDA GPU visible to JAX (jax.default_backend() is "
                f"{jax.default_backend()!r}); install a CUDA jax (pip install 'jax[cuda13]') or use "
                "backend 'interpret' (CPU, Triton interpreter) or 'xla'")
        from te_jax_perm.core.triton_backend import problems
        if found := problems():
            raise BackendUnavailableError("backend 'triton': " + "; ".join(found))
    if name in ("triton", "interpret") and importlib.util.find_spec("triton") is None:
        raise BackendUnavailableError(f"backend {name!r} needs the triton package: pip install triton")
    if name == "interpret" and jax.default_backend() != "cpu" and not _has_cpu():
        # The interpreter dereferences host pointers; GPU buffers would crash it.
        raise BackendUnavailableError("backend 'interpret' runs on the CPU platform only")


def _has_cpu() -> bool:
    try:
        return bool(jax.devices("cpu"))
    except RuntimeError:
        return False
