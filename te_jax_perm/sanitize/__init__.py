"""Hazard sanitizer for kernels run by the ``interpret`` backend (docs/sanitizer.md).

Records, per program id, the bytes every load, store and atomic touches in each buffer,
and reports out-of-bounds accesses, write-write overlaps between programs, cross-program
read/write hazards, output elements no program stores (where the output does not start as
zeros), and whether each kernel would be safe with an input and an output
sharing memory. ``TE_JAX_PERM_SANITIZE=raise`` (or ``collect``) turns it on per process.
"""
from te_jax_perm.sanitize.hazards import (IN_PLACE, INPUT_WRITE, KINDS, OOB, READ_WRITE, UNWRITTEN, WRITE_WRITE,
                                          Hazard, HazardError, LaunchSummary, Report)
from te_jax_perm.sanitize.session import ENV_VAR, check, env_report, hazard_error, sanitize

__all__ = ["ENV_VAR", "IN_PLACE", "INPUT_WRITE", "KINDS", "OOB", "READ_WRITE", "UNWRITTEN", "WRITE_WRITE", "Hazard",
           "HazardError", "LaunchSummary", "Report", "check", "env_report", "hazard_error", "sanitize"]
