"""A stand-in for a training step whose outputs' lifetimes show how many calls' buffers a
timing loop keeps alive at once."""
import weakref


class _Output:
    """Stands for one call's outputs."""


def step_probe():
    """``(step, seen)``: each ``step()`` returns a fresh output and appends to ``seen`` how
    many earlier outputs were still alive when it was called."""
    live, seen = [], []

    def step():
        seen.append(sum(ref() is not None for ref in live))
        out = _Output()
        live.append(weakref.ref(out))
        return out
    return step, seen
