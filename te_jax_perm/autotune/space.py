"""The search space of one launch: declared configs minus those a constraint rules out.

Pruning happens before anything compiles, so an invalid (e.g. racy) tiling can never be
timed, let alone picked; every pruned config is logged (verbosity 1) with the constraint's reason.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from absl import logging

from te_jax_perm.core.declaration import Config, KernelDecl


def candidates(decl: KernelDecl, dims: Mapping[str, int], params: Mapping[str, Any]
               ) -> tuple[list[Config], list[tuple[Config, str]]]:
    """Returns ``(valid, pruned)``; ``pruned`` pairs each config with the reason.

    The default config is always a candidate (if valid), so tuning can only improve on it.
    """
    space = list(dict.fromkeys(decl.configs))
    default = decl.default_config(dims, params)
    if default not in space:
        space.append(default)
    valid, pruned = [], []
    for cfg in space:
        why = decl.violated(dims, params, cfg)
        if why:
            pruned.append((cfg, why))
            logging.vlog(1, "autotune %s: pruned %s for %s: %s", decl.name, cfg, dict(dims), why)
        else:
            valid.append(cfg)
    return valid, pruned


def cap(valid: Sequence[Config], default: Config, limit: int | None, name: str = ""
        ) -> tuple[list[Config], list[Config]]:
    """At most ``limit`` of ``valid``: the default first (so a run stopped early still has
    the baseline), then evenly spaced picks over the declared order (which sweeps the
    tile/warp grid), so a capped search still spans the space. Returns ``(kept, skipped)``."""
    valid = list(valid)
    rest = [c for c in valid if c != default]
    head = [default] if default in valid else []
    if limit is None or len(valid) <= limit:
        return head + rest, []
    n = max(0, limit - len(head))
    picks = sorted({round(i * (len(rest) - 1) / max(1, n - 1)) for i in range(n)}) if n and rest else []
    kept = head + [rest[i] for i in picks]
    skipped = [c for c in rest if c not in kept]
    logging.vlog(1, "autotune %s: %d candidates over the cap of %d, skipped: %s", name, len(skipped), limit,
                 ", ".join(str(c) for c in skipped))
    return kept, skipped
