"""Safe autotuning for declared kernels (docs/autotuning.md).

Tuning never corrupts data (aliased buffers are saved and restored around identical
trials), never crashes the process (candidates compile in a crash-isolated worker pool),
never picks a wrong config (outputs are checked against the declared reference), and
never re-tunes for a value outside the declared key (results persist per key on disk).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from te_jax_perm.autotune.cache import cache_dir, format_cache, make_key, set_cache_dir
from te_jax_perm.autotune.tuner import (TuneOptions, TuneResult, autotuning, candidates, declaration, enable,
                                        enabled, resolve, stats, tune, tune_call,
                                        tuning_backend)


def tune_ahead(kernel: Any, shapes_and_params: Iterable[tuple[Sequence[Any], Mapping[str, Any]]],
               backend: str | None = None, options: TuneOptions = TuneOptions()) -> list[TuneResult]:
    """Tunes ``kernel`` (a ``KernelDecl`` or declared primitive) for each
    ``(operand shapes, static params)``; operand shapes and ``backend`` as in :func:`tune`."""
    decl = declaration(kernel)
    items = list(shapes_and_params)
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], (tuple, list))
                and (item[1] is None or isinstance(item[1], Mapping))):
            raise TypeError(f"tune_ahead: shapes_and_params[{i}] is {item!r}; expected an (operand shapes, static "
                            "params) pair, e.g. ([((16, 96), np.float32), ((5,), np.int32)], {})")
    return [tune(decl, shapes, params, backend, options) for shapes, params in items]


def print_cache() -> None:
    """Prints every cached tuning result (kernel, key, best config, counts)."""
    print(format_cache())


__all__ = ["TuneOptions", "TuneResult", "autotuning", "cache_dir", "candidates", "enable", "enabled",
           "format_cache", "make_key", "print_cache", "resolve", "set_cache_dir", "stats",
           "tune", "tune_ahead", "tune_call", "tuning_backend"]
