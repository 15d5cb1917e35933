"""Which versions of jax, Triton and jax-triton work together for the ``triton`` backend.

One table, read by the backend (its :class:`BackendUnavailableError` messages name the
missing or mismatched package and the command that fixes it) and by the test that checks
the ``[cuda]`` extra's pins against it.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# jaxlib registers the typed-FFI Triton call ``triton_kernel_call_ffi`` from 0.10.1 on; older
# releases have only the legacy custom call ``triton_kernel_call``.
FFI_MIN_JAXLIB = Version("0.10.1")
# What the ``triton`` backend needs in every call mode.
JAX_SPEC = SpecifierSet(">=0.10")
TRITON_SPEC = SpecifierSet(">=3.6")
# The Triton releases run on a GPU with this library (the [cuda] extra pins one of them).
TRITON_TESTED_SPEC = SpecifierSet(">=3.6,<3.7")


@dataclasses.dataclass(frozen=True)
class JaxTritonPair:
    """A jax-triton release series and what it needs (only the ``jax_triton`` call mode
    uses jax-triton; the default call modes do not)."""

    jax_triton: SpecifierSet
    triton: SpecifierSet
    jax: SpecifierSet
    python: SpecifierSet


JAX_TRITON_PAIRS = (
    # 0.3.x declares triton>=3.6 but only works with 3.6.x: pin it.
    JaxTritonPair(SpecifierSet(">=0.3.1,<0.4"), SpecifierSet(">=3.6,<3.7"), SpecifierSet(">=0.8.2"),
                  SpecifierSet(">=3.11")),
    # 0.4.x fails to import with triton 3.6.
    JaxTritonPair(SpecifierSet(">=0.4,<0.5"), SpecifierSet(">=3.7"), SpecifierSet(">=0.11"),
                  SpecifierSet(">=3.12")),
)


def installed(package: str) -> Version | None:
    try:
        return Version(importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None


def problems(mode: str) -> list[str]:
    """What keeps the ``triton`` backend's call ``mode`` (``ffi``, ``legacy``, ``jax_triton``)
    from working with the installed packages; each entry says how to fix it."""
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
    elif mode == "ffi" and jaxlib < FFI_MIN_JAXLIB:
        out.append(f"jaxlib {jaxlib} has no typed-FFI Triton call (it came in {FFI_MIN_JAXLIB}): "
                   f"pip install 'jax[cuda13]>={FFI_MIN_JAXLIB}', or set TE_JAX_PERM_TRITON_CALL=legacy")
    if mode == "jax_triton":
        out.extend(_jax_triton_problems(triton))
    return out


def _jax_triton_problems(triton: Version | None) -> list[str]:
    import sys
    jt, jax = installed("jax-triton"), installed("jax")
    python = Version("{}.{}.{}".format(*sys.version_info[:3]))
    if jt is None:
        return ["TE_JAX_PERM_TRITON_CALL=jax_triton needs the jax-triton package: pip install 'jax-triton==0.3.1' "
                "'triton>=3.6,<3.7' (or unset it: the default call needs no jax-triton)"]
    for pair in JAX_TRITON_PAIRS:
        if jt in pair.jax_triton:
            wrong = [f"{name} {have} (needs {name}{spec})" for name, have, spec in
                     (("triton", triton, pair.triton), ("jax", jax, pair.jax), ("python", python, pair.python))
                     if have is not None and have not in spec]
            return [f"jax-triton {jt} does not work with " + ", ".join(wrong) +
                    f": pip install 'triton{pair.triton}'"] if wrong else []
    return [f"jax-triton {jt} is not a release this library knows; use jax-triton 0.3.1 with triton 3.6.x"]
