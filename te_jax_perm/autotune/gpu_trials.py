"""``triton`` trials: each candidate's pool-compiled binary launched on device buffers.

Buffers are torch CUDA tensors (torch is on the GPU machine; Triton launches on torch's
current stream), timed with CUDA events. The binary is loaded from the Triton cache the
pool workers filled, so nothing is recompiled here. Imported only on the GPU path.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from te_jax_perm.autotune.compile_job import CompileJob, load_compiled
from te_jax_perm.core.declaration import Config, KernelDecl
from te_jax_perm.core.kernel_args import kernel_arguments
from te_jax_perm.core.launch import bind_call, configure

# NumPy dtypes torch cannot take directly travel as same-width integers, then are viewed back.
_VIA_INT = {"bfloat16": ("int16", "bfloat16"), "float8_e4m3fn": ("uint8", "float8_e4m3fn"),
            "float8_e5m2": ("uint8", "float8_e5m2")}


def to_device(a: np.ndarray) -> Any:
    import torch
    a = np.ascontiguousarray(a)
    if a.dtype.name in _VIA_INT:
        carrier, name = _VIA_INT[a.dtype.name]
        return torch.from_numpy(a.view(carrier)).cuda().view(getattr(torch, name))
    if a.dtype == np.bool_:
        return torch.from_numpy(a).cuda()
    return torch.from_numpy(a).cuda()


def to_host(t: Any, dtype: np.dtype) -> np.ndarray:
    import torch  # noqa: F401
    dtype = np.dtype(dtype)
    if dtype.name in _VIA_INT:
        carrier, _ = _VIA_INT[dtype.name]
        import torch as _t
        return t.view(getattr(_t, carrier)).cpu().numpy().view(dtype)
    return t.cpu().numpy()


class GpuRunner:
    def __init__(self, decl: KernelDecl, inputs: Sequence[np.ndarray], preallocs: Sequence[np.ndarray],
                 params: Mapping[str, Any], jobs: Mapping[Config, CompileJob]):
        import torch
        self.torch = torch
        self.decl, self.jobs = decl, jobs
        self.call = bind_call(decl, inputs, params, "triton")
        self.out_dtypes = [a.dtype for a in preallocs]
        self.buffers = [to_device(a) for a in inputs] + [to_device(a) for a in preallocs]
        self.n_in = len(inputs)
        self.saved: dict[int, Any] = {}
        self._compiled: dict[Config, Any] = {}
        self._launch_args: dict[Config, tuple] = {}
        self._expected: tuple[int, list[Any]] | None = None

    def save(self, indices: Sequence[int]) -> None:
        self.saved = {i: self.buffers[i].clone() for i in indices}

    def restore(self) -> None:
        for i, snap in self.saved.items():
            self.buffers[i].copy_(snap)

    def _kernel(self, config: Config) -> Any:
        if config not in self._compiled:
            self._compiled[config] = load_compiled(self.jobs[config])
        return self._compiled[config]

    def _args(self, config: Config) -> tuple:
        """Grid and argument list of ``config``, built once (not per timed launch)."""
        if config not in self._launch_args:
            ins, outs = self.buffers[:self.n_in], self.buffers[self.n_in:]
            launch = configure(self.call, config)
            # Triton's launcher takes constexprs too; each output is its own preallocated buffer.
            args = [a.value for a in kernel_arguments(launch, ins, outs, outs)] + list(launch.constexprs.values())
            self._launch_args[config] = (launch.grid3, args, self._kernel(config))
        return self._launch_args[config]

    def launch(self, config: Config) -> float:
        torch = self.torch
        grid, args, kernel = self._args(config)
        if any(g == 0 for g in grid):
            return 0.0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel[grid](*args)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def mismatch(self, expected: Sequence[np.ndarray]) -> str | None:
        """``validate.mismatch`` on the device: a 100+ MB output is compared where it lies
        instead of being copied to the host and walked by NumPy for every trial."""
        torch, decl = self.torch, self.decl
        if self._expected is None or self._expected[0] != id(expected):
            self._expected = (id(expected), [to_device(np.asarray(w)) for w in expected])
        for o, g, w, wn in zip(decl.outputs, self.buffers[self.n_in:], self._expected[1], expected):
            wn = np.asarray(wn)
            if tuple(g.shape) != wn.shape or g.element_size() != wn.dtype.itemsize:
                return f"{o.name}: shape {tuple(g.shape)} != reference {wn.shape} {wn.dtype}"
            floating = np.issubdtype(wn.dtype, np.floating) or wn.dtype.name.startswith(("bfloat", "float"))
            if decl.exact or not floating:
                gb = g.reshape(-1).view(torch.uint8).reshape(-1, g.element_size())
                wb = w.reshape(-1).view(torch.uint8).reshape(-1, w.element_size())
                n = int((gb != wb).any(dim=1).sum().item())
                if n:
                    return f"{o.name}: {n} of {g.numel()} elements differ bitwise from the reference"
            else:
                gf, wf = g.float(), w.float()
                ok = torch.isclose(gf, wf, rtol=decl.rtol, atol=decl.atol, equal_nan=True)
                bad = int((~ok).sum().item())
                if bad:
                    i = tuple(int(x) for x in np.unravel_index(int(torch.argmin(ok.to(torch.int8)).item()), tuple(ok.shape)))
                    return (f"{o.name}: {bad} of {g.numel()} elements outside rtol={decl.rtol} "
                            f"atol={decl.atol}; e.g. at {i}: {float(gf[i])} vs {float(wf[i])}")
        return None

    def outputs(self) -> list[np.ndarray]:
        return [to_host(b, dt) for b, dt in zip(self.buffers[self.n_in:], self.out_dtypes)]
