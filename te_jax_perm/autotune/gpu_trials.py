"""``triton`` trials: each candidate run through the XLA call the backend lowers to.

A trial is a jitted ``triton_call`` of the candidate's launch on JAX device buffers, so it
is the very custom call (same compiled kernel, same arguments, same aliases) a lowered
program runs. The preallocated output buffers are donated to each trial and written in
place, as in production; this runner keeps their initial contents and restores them
before every launch itself (the trials never rely on XLA copying a buffer for them).

Time per launch is taken on the device: a chain of ``chain`` dependent launches (each
writes the buffers the next one is handed) minus a single launch, over ``chain - 1``, so
the host's dispatch and synchronisation cost cancels out and back-to-back kernel time is
left. Imported only on the GPU path.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from te_jax_perm.autotune.validate import mismatch
from te_jax_perm.core.declaration import Config, KernelDecl
from te_jax_perm.core.launch import bind_call, configure


class GpuRunner:
    """Runs configs of one call on fixed device buffers: operands, then preallocated outputs."""

    def __init__(self, decl: KernelDecl, inputs: Sequence[np.ndarray], preallocs: Sequence[np.ndarray],
                 params: Mapping[str, Any], chain: int = 16):
        import jax
        self.jax, self.decl, self.chain = jax, decl, chain
        self.call = bind_call(decl, inputs, params, "triton")
        self.n_in = len(inputs)
        self.operands = [jax.device_put(a) for a in inputs]
        self.buffers = [jax.device_put(a) for a in preallocs]  # the outputs' current contents
        self.saved: dict[int, Any] = {}
        self._exes: dict[tuple[Config, int], Callable] = {}
        self._expected: tuple[int, list[Any]] | None = None

    def save(self, indices: Sequence[int]) -> None:
        """Keeps the contents of the written buffers (operand indices: preallocs follow operands)."""
        self.saved = {i: self._copy(self.buffers[i - self.n_in]) for i in indices}

    def restore(self) -> None:
        for i, snap in self.saved.items():
            self.buffers[i - self.n_in] = self._copy(snap)
        self.jax.block_until_ready(self.buffers)

    def _copy(self, a: Any) -> Any:
        return self.jax.numpy.copy(a)

    def _exe(self, config: Config, n: int) -> Callable:
        """``n`` dependent launches of ``config``, its buffers donated; compiled once."""
        if (config, n) not in self._exes:
            from te_jax_perm.core.triton_backend import triton_call
            launch = configure(self.call, config)

            def run(operands, buffers):
                for _ in range(n):
                    buffers = triton_call(launch, operands, buffers)
                return buffers

            jit = self.jax.jit(run, donate_argnums=1)
            self._exes[(config, n)] = jit.lower(self.operands, self.buffers).compile()
        return self._exes[(config, n)]

    def _timed(self, exe: Callable, buffers: list) -> tuple[float, list]:
        t0 = time.perf_counter()
        out = exe(self.operands, buffers)
        self.jax.block_until_ready(out)
        return time.perf_counter() - t0, list(out)

    def launch(self, config: Config) -> float:
        """One launch on the current buffers (its outputs are kept for checking); returns the
        device time of a launch, from a chain of launches on a copy of the same buffers."""
        single, chained = self._exe(config, 1), self._exe(config, self.chain)
        spare = [self._copy(b) for b in self.buffers]
        self.jax.block_until_ready(spare)
        t1, self.buffers = self._timed(single, self.buffers)
        tn, _ = self._timed(chained, spare)
        return max(tn - t1, 0.0) / (self.chain - 1)

    def mismatch(self, expected: Sequence[np.ndarray]) -> str | None:
        """The reference comparison on the device: a 100+ MB output is compared where it lies."""
        if self._expected is None or self._expected[0] != id(expected):
            self._expected = (id(expected), [self.jax.device_put(w) for w in expected])
        return mismatch(self.decl, self.buffers, self._expected[1], xp=self.jax.numpy)

    def outputs(self) -> list[np.ndarray]:
        return [np.asarray(b) for b in self.buffers]
