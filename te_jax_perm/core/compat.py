"""Which versions of jax and Triton the ``triton`` backend works with.

One table, read by the backend (its :class:`BackendUnavailableError` messages name the
missing or mismatched package and the command that fixes it) and by the test that checks
the ``[cuda]`` extra's pins against it.
"""
from __future__ import annotations

import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# jaxlib registers the typed-FFI Triton call ``triton_kernel_call_ffi`` from 0.10.1 on.
FFI_MIN_JAXLIB = Version("0.10.1")
JAX_SPEC = SpecifierSet(f">={FFI_MIN_JAXLIB}")
TRITON_SPEC = SpecifierSet(">=3.6")
# The Triton releases run on a GPU with this library (the [cuda] extra pins one of them).
TRITON_TESTED_SPEC = SpecifierSet(">=3.6,<3.7")


def installed(package: str) -> Version | None:
    try:
        return Version(importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None


def problems() -> list[str]:
    """What keeps the ``triton`` backend from working with the installed packages; each
    entry says how to fix it."""
    out = []
    jaxlib, triton = installed("jaxlib"), installed("triton")
    if triton is None:
        out.append("the triton package is not installed: pip install 'te_jax_perm[cuda]'")
    elif triton not in TRITON_SPEC:
        out.append(f"triton {triton} is installed; the triton backend needs triton{TRITON_SPEC}: "
                   "pip install 'te_jax_perm[cuda]'")
    if jaxlib is None or jaxlib not in JAX_SPEC:
        out.append(f"jaxlib {jaxlib or '(missing)'}: the triton backend needs jax{JAX_SPEC} with CUDA: "
                   "pip install 'te_jax_perm[cuda]'")
    return out
