"""Running a test module again on 8 virtual CPU devices.

XLA_FLAGS must be set before jax starts, so a module's multi-device tests run in a pytest
subprocess started by its driver test; in the ordinary single-device run they skip.
"""
import os
import subprocess
import sys

import pytest

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")

MULTI = os.environ.get("TE_JAX_PERM_MULTIDEVICE") == "1"
multidevice = pytest.mark.skipif(not MULTI, reason="runs in the 8-device subprocess")


def run_module_on_8_devices(module_file: str) -> None:
    if MULTI:
        pytest.skip("already in the 8-device subprocess")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # JAX_PLATFORMS=cpu: the 8 devices are virtual CPU devices, also on a GPU machine.
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "TE_JAX_PERM_MULTIDEVICE": "1", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TE_JAX_PERM_BACKEND", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(module_file)],
                       env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]


def collectives(f, *args) -> list[str]:
    """The collective ops in ``f``'s compiled module for ``args``."""
    import jax
    txt = jax.jit(f).lower(*args).compile().as_text()
    return [c for c in COLLECTIVES if c in txt]
