"""The triton backend's calls are captured in XLA command buffers (CUDA graphs).

The jitted dispatch -> combine forward+backward step runs in two fresh processes: one
with XLA's default flags (command buffers on), one with ``--xla_gpu_enable_command_buffer=``
(off). The outputs must be bit-identical, and the step must run markedly faster with them
on: what capture removes is the host launch of each kernel, ours included. XLA converts to command buffers after HLO
optimisation, at the thunk level, so the optimized HLO text does not show them; XLA also
runs a command buffer's thunks one by one while a profiler is attached, so the profiled
launches only confirm which kernels ran. It times, so it runs alone:
``python3 -m tests.gpu.run --steps=capture``.
"""
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(tmp_path, name, command_buffers_on, *step):
    flags = re.sub(r"--xla_gpu_enable_command_buffer=\S*", "", os.environ.get("XLA_FLAGS", "")).strip()
    if not command_buffers_on:
        flags += " --xla_gpu_enable_command_buffer="
    env = dict(os.environ, XLA_FLAGS=flags.strip(), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    npz, js = tmp_path / f"{name}.npz", tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.capture_step", "--npz", str(npz), "--json", str(js), *step],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(js.read_text())
    with np.load(npz) as z:  # as bytes, and each in its dtype
        outs = [z[k] for k in sorted(z.files, key=lambda s: int(s.split("_")[1]))]
    return outs, report


@pytest.mark.gpu
def test_dispatch_combine_step_is_captured_in_command_buffers(tmp_path):
    on_outs, on = _run(tmp_path, "on", True)
    off_outs, off = _run(tmp_path, "off", False)
    print("command buffers on:", json.dumps({k: v for k, v in on.items() if k != "kernels"}))
    print("command buffers off:", json.dumps({k: v for k, v in off.items() if k != "kernels"}))
    assert len(on_outs) == len(off_outs) == 2
    for a, b in zip(on_outs, off_outs):
        np.testing.assert_array_equal(a, b)  # bit-identical (compared as bytes)
    assert on["our_kernels"] and on["our_kernels_per_step"] >= len(on["our_kernels"]), on
    if off["api_events_seen"]:
        assert off["graph_launches_per_step"] == 0, off  # off really is off
    # Proof of capture from the profiler's CUDA API records (not from timing, which is noisy
    # on a shared machine): with command buffers on, the whole step, our kernels included,
    # is one CUDA graph launch and no kernel is launched on its own.
    assert on["api_events_seen"], on
    assert on["graph_launches_per_step"] >= 1 and on["kernel_launches_per_step"] == 0, on


@pytest.mark.gpu
def test_tma_gemm_kernels_run_inside_command_buffers(tmp_path):
    """The grouped GEMM's TMA kernels (on Hopper its default forward and input gradient at
    these sizes, and its warp-specialised weight gradient) build tensor descriptors in
    global scratch memory.
    A jitted training step of two expert layers (in a ``lax.scan``) with command buffers on
    runs them inside the step's CUDA graph, and computes what the default configs compute.
    (Scratch allocated on the stream at each launch cannot live in a captured graph: the
    step would fail with CUDA_ERROR_NOT_SUPPORTED.)"""
    import ml_dtypes
    step = ["--step", "expert_gemms", "--tokens", "2048"]
    default_outs, default = _run(tmp_path, "default", True, *step)
    tma_outs, tma = _run(tmp_path, "tma", True, *step, "--configs", "tma")
    print("default configs:", json.dumps({k: v for k, v in default.items() if k != "kernels"}))
    print("TMA configs:", json.dumps({k: v for k, v in tma.items() if k != "kernels"}))
    # Each GEMM of the step builds its descriptors on the device: a TMA config, or a
    # warp-specialised kernel (Hopper's default weight gradient here).
    assert len(tma["configs"]) == 3 and all("TMA=True" in c or name.endswith("_ws")
                                            for name, c in tma["configs"].items()), tma["configs"]
    for a, b, dtype in zip(default_outs, tma_outs, tma["dtypes"]):
        a, b = (v.view(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype).astype(np.float32) for v in (a, b))
        assert np.isfinite(b).all()
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2)
    for report in (default, tma):
        assert report["api_events_seen"], report
        assert report["graph_launches_per_step"] >= 1 and report["kernel_launches_per_step"] == 0, report
