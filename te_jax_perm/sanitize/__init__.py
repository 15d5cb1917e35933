"""Hazard sanitizer for kernels run by the ``interpret`` backend.

Records, per program id, the bytes every load, store and atomic touches in each buffer,
and reports out-of-bounds accesses, write-write overlaps between programs, cross-program
read/write hazards, and whether each kernel would be safe with an input and an output
sharing memory (see docs/sanitizer.md)::

    with te_jax_perm.sanitize.sanitize() as report:
        jax.block_until_ready(my_prim(x, idx, backend="interpret"))
    assert not report, report.text()

Or set ``TE_JAX_PERM_SANITIZE=raise`` (or ``collect``) in the environment. A hazard raised
inside a function you ``jax.jit`` outside a ``sanitize()`` scope reaches you as XLA's
``JaxRuntimeError``, whose message ends with the hazard's text; :func:`hazard_error` gives
back the :class:`HazardError` itself.
"""
from te_jax_perm.sanitize.hazards import (IN_PLACE, INPUT_WRITE, KINDS, OOB, READ_WRITE, WRITE_WRITE, Hazard,
                                          HazardError, LaunchSummary, Report)
from te_jax_perm.sanitize.session import ENV_VAR, check, env_report, hazard_error, sanitize

__all__ = ["ENV_VAR", "IN_PLACE", "INPUT_WRITE", "KINDS", "OOB", "READ_WRITE", "WRITE_WRITE", "Hazard",
           "HazardError", "LaunchSummary", "Report", "check", "env_report", "hazard_error", "sanitize"]
