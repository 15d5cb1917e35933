"""``interpret`` backend: the real Triton kernel, run by Triton's interpreter on the CPU.

The kernel runs inside a ``buffer_callback`` custom call whose preallocated outputs carry
the same declared aliases as the GPU's, so CPU tests exercise the ``triton`` backend's
aliasing contract. Launch observers (``core.hooks``: the sanitizer) see every buffer
passed to the kernel and each program's start.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from te_jax_perm.core import interpret_numerics
from te_jax_perm.core import hooks
from te_jax_perm.core.aliasing import preallocate
from te_jax_perm.core.hooks import BufferInfo
from te_jax_perm.core.kernel_args import OPERAND, kernel_arguments
from te_jax_perm.core.launch import Launch


class HostPointer:
    """Adapter giving a host NumPy buffer the ``data_ptr()``/``dtype`` face Triton expects."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data


# Triton's interpreter keeps the grid position in one global builder, and XLA's CPU runtime
# may run independent custom calls on different threads: launches must not interleave.
_launch_lock = threading.RLock()


def launch_interpreted(kernel: Any, grid: Sequence[int], args: Mapping[str, Any],
                       constexprs: Mapping[str, Any], *, name: str = "",
                       buffers: Sequence[BufferInfo] = ()) -> None:
    """Runs ``kernel`` (a ``@triton.jit`` function) over ``grid`` with the interpreter;
    ``args`` maps its parameter names to :class:`HostPointer` or Python scalars."""
    from triton.runtime import interpreter as interp  # lazy: keep import cost off xla-only use

    interpret_numerics.install()   # the GPU's rounding, not the interpreter's
    grid3 = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if any(g == 0 for g in grid3):
        return
    with _launch_lock, _nested_jit_calls(interp):
        observers = hooks.launch_observers()
        for ob in observers:
            ob.launch_begin(name or kernel.fn.__name__, buffers, grid3)
        try:
            with _interpreted(interp, kernel.fn) as fn:
                call_args = {k: interp._implicit_cvt(v) for k, v in args.items()}
                call_args.update(constexprs)
                interp.interpreter_builder.set_grid_dim(*grid3)
                for x, y, z in itertools.product(*(range(g) for g in grid3)):
                    interp.interpreter_builder.set_grid_idx(x, y, z)
                    for ob in observers:
                        ob.program_begin((x, y, z))
                    fn(**call_args)
        finally:
            for ob in observers:
                ob.launch_end()


_rewritten: dict[Any, Any] = {}


@contextlib.contextmanager
def _interpreted(interp: Any, fn: Any) -> Iterator[Callable]:
    """``fn``'s interpreter rewrite (made once), the language patched for it in the block."""
    if fn not in _rewritten:
        _rewritten[fn] = interp.InterpretedFunction(fn).rewrite()
    scope = interp._patch_lang(fn)
    interpret_numerics.patch_scalar_index(scope)
    try:
        yield _rewritten[fn]
    finally:
        scope.restore()


@contextlib.contextmanager
def _nested_jit_calls(interp: Any) -> Iterator[None]:
    """Lets a kernel call other ``@triton.jit`` functions (helpers, ``tl.sum``...): outside
    ``TRITON_INTERPRET=1`` their ``__call__`` refuses to run, so it runs their rewrite."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.__call__

    def call(self, *a, **kw):
        with _interpreted(interp, self.fn) as fn:
            return fn(*a, **kw)

    JITFunction.__call__ = call
    try:
        yield
    finally:
        JITFunction.__call__ = original


def run_launch(launch: Launch, operands: Sequence[np.ndarray], preallocs: Sequence[np.ndarray],
               outputs: Sequence[np.ndarray]) -> None:
    """Runs ``launch`` on host buffers (outputs may be the preallocs themselves)."""
    args = kernel_arguments(launch, operands, preallocs, outputs)
    infos = [BufferInfo(a.source, "input" if a.role == OPERAND else a.role, a.value.ctypes.data, a.value.nbytes,
                        a.value.dtype, tuple(a.value.shape)) for a in args if a.is_pointer]
    values = {a.name: HostPointer(a.value) if a.is_pointer else a.value for a in args}
    launch_interpreted(launch.decl.kernel, launch.grid, values, launch.constexprs, name=launch.decl.name,
                       buffers=infos)


# The error the last failed launch raised: XLA hands it on as its own runtime error (text
# only), so an eager call re-raises this object instead (a sanitizer's HazardError, say).
# XLA's CPU runtime may run the callbacks on other threads: the list is read under a lock.
_raised: list[BaseException] = []
_raised_lock = threading.Lock()


def _take_raised() -> BaseException | None:
    with _raised_lock:
        return _raised.pop() if _raised else None


def run_eagerly(fn: Callable[..., Any], args: Sequence[jax.Array]) -> Any:
    """``fn(*args)`` for an eager ``interpret`` call, finished: on the first CPU device (the
    interpreter dereferences host pointers), a launch's error raised as itself."""
    _take_raised()
    try:
        if jax.default_backend() == "cpu":
            return jax.block_until_ready(fn(*args))
        cpu = jax.devices("cpu")[0]
        with jax.default_device(cpu):
            return jax.block_until_ready(fn(*jax.device_put(tuple(args), cpu)))
    except jax.errors.JaxRuntimeError:
        raised = _take_raised()
        if raised is None:
            raise
        raise raised from None


def interpret_call(launch: Launch, operands: Sequence[jax.Array]) -> list[jax.Array]:
    """Traceable function emitting one aliased buffer_callback custom call."""
    from jax.experimental.buffer_callback import buffer_callback

    plan = launch.aliases
    preallocs = preallocate(plan, launch.out_avals)

    def callback(ctx, outs, *ins):
        del ctx
        in_arrays = [np.asarray(b) for b in ins]
        try:
            run_launch(launch, in_arrays[:plan.num_operands], in_arrays[plan.num_operands:],
                       [np.asarray(b) for b in outs])
        except Exception as e:
            with _raised_lock:
                _raised[:] = [e]
            raise

    result_types = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in launch.out_avals]
    with jax.named_scope(f"te_jax_perm.{launch.decl.name}"):
        outs = buffer_callback(callback, result_types, input_output_aliases=plan.input_output_aliases)(
            *operands, *preallocs)
    return list(outs)
