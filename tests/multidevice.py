"""Running a test module's multi-device tests on 8 virtual CPU devices.

XLA_FLAGS must be set before jax starts, so a module's tests marked :data:`multidevice`
run in pytest subprocesses started by its driver test, and only there; in the ordinary
single-device run they skip, and the subprocesses run nothing else (``conftest``).
"""
import os
import re
import subprocess
import sys

import pytest

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")

MULTI = os.environ.get("TE_JAX_PERM_MULTIDEVICE") == "1"
multidevice = pytest.mark.multidevice
# The multi-device tests of a module split over this many subprocesses, run at once: on a
# machine with cores to spare they are otherwise the suite's longest test (three minutes on
# a GPU machine's 16 cores); a small machine's cores are busy with the other tests.
SHARDS = max(1, min(4, (os.cpu_count() or 1) // 4))


def shard_of(items: list) -> list:
    """The items this subprocess runs: every ``n``-th from ``i`` for ``TE_JAX_PERM_TEST_SHARD=i/n``."""
    i, n = (int(v) for v in os.environ.get("TE_JAX_PERM_TEST_SHARD", "0/1").split("/"))
    return items[i::n]


def without_cpu_devices() -> str:
    """This process's XLA_FLAGS without any virtual CPU device count."""
    return re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", "")).strip()


def with_cpu_devices(n: int) -> str:
    """This process's XLA_FLAGS with ``n`` virtual CPU devices in place of any device count."""
    return f"{without_cpu_devices()} --xla_force_host_platform_device_count={n}".strip()


def run_module_on_8_devices(module_file: str) -> None:
    if MULTI:
        pytest.skip("already in the 8-device subprocess")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # JAX_PLATFORMS=cpu: the 8 devices are virtual CPU devices, also on a GPU machine.
    env = {**os.environ, "XLA_FLAGS": with_cpu_devices(8), "JAX_PLATFORMS": "cpu",
           "TE_JAX_PERM_MULTIDEVICE": "1", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TE_JAX_PERM_BACKEND", None)
    runs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              os.path.abspath(module_file)], env={**env, "TE_JAX_PERM_TEST_SHARD": f"{i}/{SHARDS}"},
                             cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(SHARDS)]
    for i, run in enumerate(runs):
        try:
            out, err = run.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for r in runs:
                r.kill()
            raise
        assert run.returncode == 0, f"shard {i}/{SHARDS}:\n" + out[-6000:] + err[-3000:]
        assert " passed" in out and " failed" not in out, f"shard {i}/{SHARDS}:\n" + out[-2000:]


def shardy_all_gspmd_some(cases: list[tuple], ids: list[str], gspmd: tuple[int, ...]) -> list:
    """Parameters ``(partitioner, *case)`` for a test using the ``partitioner`` fixture
    indirectly: every case under Shardy (JAX's default partitioner) and the cases numbered
    ``gspmd`` under GSPMD too, for tests whose cases each cost seconds of compiling and
    whose partitioner-specific part a few of them exercise."""
    return ([pytest.param(True, *c, id=f"shardy-{i}") for c, i in zip(cases, ids)]
            + [pytest.param(False, *cases[n], id=f"gspmd-{ids[n]}") for n in gspmd])


def collectives(f, *args) -> list[str]:
    """The collective ops in ``f``'s compiled module for ``args``."""
    import jax
    return collectives_in(jax.jit(f).lower(*args).compile())


def collectives_in(compiled) -> list[str]:
    """The collective ops in a compiled module (what ``jax.jit(f).lower(...).compile()`` gives)."""
    txt = compiled.as_text()
    return [c for c in COLLECTIVES if c in txt]
