"""A record of the kernels the ``interpret`` backend launches, through the launch-observer
hook (``core.hooks``), for tests that check which kernel ran and on what grid."""
import contextlib

from te_jax_perm.core import hooks


class _Recorder:
    def __init__(self, seen):
        self.seen = seen

    def launch_begin(self, kernel_name, buffers, grid):
        self.seen.append((kernel_name, tuple(grid)))

    def launch_end(self):
        pass


@contextlib.contextmanager
def recorded_launches():
    """Within the block, a list that gains ``(kernel name, grid)`` for every launch."""
    seen = []
    recorder = _Recorder(seen)
    hooks.add_launch_observer(recorder)
    try:
        yield seen
    finally:
        hooks.remove_launch_observer(recorder)
