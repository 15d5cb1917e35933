"""Shared test set-up: GPU tests skip without a CUDA GPU; CPU backends are parametrizable."""
import os

# Tests must not depend on a developer's environment default.
os.environ.pop("TE_JAX_PERM_BACKEND", None)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

ON_GPU = jax.default_backend() == "gpu"
CPU_BACKENDS = ("xla", "interpret")
ALL_BACKENDS = ("xla", "interpret", "triton") if ON_GPU else ("xla", "interpret")


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with jax-triton (run tests/gpu/run_gpu_tests.sh there)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=CPU_BACKENDS)
def cpu_backend(request):
    return request.param


@pytest.fixture(params=("triton",) if ON_GPU else ())
def gpu_backend(request):
    return request.param
