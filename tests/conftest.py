"""Shared test set-up: GPU tests skip without a CUDA GPU; CPU backends are parametrizable."""
import importlib.metadata
import os

# Tests must not depend on a developer's environment default.
os.environ.pop("TE_JAX_PERM_BACKEND", None)


def _cpu_only() -> bool:
    """Whether jax can start nothing but its CPU backend here (decided before jax starts)."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return True
    return not any((d.metadata["Name"] or "").lower().replace("_", "-").startswith("jax-cuda")
                   for d in importlib.metadata.distributions())


def _jaxlib_before(major: int, minor: int) -> bool:
    """Whether the installed jaxlib is older than ``major.minor`` (read before jax starts)."""
    try:
        parts = importlib.metadata.version("jaxlib").split(".")[:2]
        return tuple(int(p) for p in parts) < (major, minor)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False


# On CPU this suite is compile-bound: thousands of small XLA programs, most run once or
# twice on tiny arrays, and LLVM's optimisation passes were about a third of their compile
# time (test_dispatch.py 130 s -> 94 s on two cores). XLA:CPU's MLIR fusion emitters then
# took about a third of what was left: its older emitters compile the same fusions directly
# to LLVM IR (test_te_contract.py and test_dispatch.py 372 -> 251 s of CPU time on two
# cores). Subprocesses inherit the flags; a flag already in XLA_FLAGS keeps its value.
# A GPU machine keeps XLA's defaults: its GPU tests run what users run. XLA stops the
# process at an unknown flag, and jaxlib 0.11's XLA no longer knows the emitters' flag (its
# CPU subprocesses on GPU machines would die), so that one goes only to older jaxlibs.
CPU_TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",) + (
    ("--xla_cpu_use_fusion_emitters=false",) if _jaxlib_before(0, 11) else ())
if _cpu_only():
    for _flag in CPU_TEST_XLA_FLAGS:
        if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from te_jax_perm.workloads import topk_routing  # noqa: E402

jax.config.update("jax_enable_x64", False)

ON_GPU = jax.default_backend() == "gpu"
# The kernel backends that can run here: the interpreter on CPU, the compiled kernel on GPU.
KERNEL_BACKEND = "triton" if ON_GPU else "interpret"
BACKENDS_HERE = ("xla", KERNEL_BACKEND)


def pytest_collection_modifyitems(config, items):
    from tests.multidevice import MULTI, shard_of
    if MULTI:
        # An 8-device subprocess runs its share of the multi-device tests and nothing else:
        # the parent process runs the rest.
        keep = shard_of([item for item in items if item.get_closest_marker("multidevice") is not None])
        kept = set(keep)   # a set: a list's `in` made this quadratic in the suite's size
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = keep
    # Long tests first (a stable sort keeps the rest in file order): started last, one of
    # them would leave the other workers idle at the end of a parallel run.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    skips = {"multidevice": pytest.mark.skip(reason="runs in the 8-device subprocess")} if not MULTI else {}
    if not ON_GPU:
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        for marker, skip in skips.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


@pytest.fixture(params=BACKENDS_HERE)
def backend(request):
    """Every op test runs on the reference and on the real kernel of this machine."""
    return request.param


@pytest.fixture
def kernel_backend():
    return KERNEL_BACKEND


@pytest.fixture
def on_cpu():
    """Places computations on the CPU device, also on a GPU machine: for tests of the
    ``interpret`` backend (and of what is built on it, the sanitizer and the tuner's CPU
    trials), whose kernels run on host buffers."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(params=[True, False], ids=["shardy", "gspmd"])
def partitioner(request):
    """Runs a test under Shardy and under GSPMD propagation."""
    import jax
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param)
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", old)


@pytest.fixture
def tmp_cache(tmp_path):
    """A private, empty tuning cache (and fresh tuner counters) for one test."""
    from te_jax_perm import autotune
    autotune.set_cache_dir(tmp_path / "cache")
    autotune.stats.clear()
    yield tmp_path / "cache"
    autotune.set_cache_dir(None)


def compiled_for_sm90(call, config):
    """The bound ``call``'s kernel at ``config``, compiled here for sm_90 exactly as the
    ``triton`` backend compiles it (no GPU needed); skips the test where this Triton build
    has no CUDA toolchain."""
    from te_jax_perm.core import configure, triton_backend
    try:
        return triton_backend.compiled_for(configure(call, config), 90)
    except Exception as e:  # no CUDA toolchain in this triton build
        if "ptxas" in str(e).lower() or "cuda" in str(e).lower():
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        raise


# -- routing ---------------------------------------------------------------------------------
def routing(rng: np.random.Generator, t: int, e: int, k: int, skew: str = "uniform") -> np.ndarray:
    """bool [T, E]: the map of the library's routing generator (``workloads.topk_routing``,
    ``skew`` as it takes it), each token routed to ``min(k, e)`` experts: property tests draw
    ``k`` and ``e`` independently."""
    return topk_routing(rng, t, e, min(k, e), skew)[0]
