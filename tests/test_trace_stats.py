"""The profiler helper of the benchmarks (benchmarks/trace_stats.py)."""
import weakref

from benchmarks import trace_stats


class _Output:
    """Stands for one call's outputs: its lifetime shows which calls' buffers are live."""


def test_back_to_back_profile_keeps_one_call_live(tmp_path):
    """Enqueued back to back, every call's outputs are dropped before the next call: a
    profile that kept them all would hold six steps' weight gradients at once (135 GB at
    DeepSeek-V3's layer)."""
    live, seen = [], []

    def step():
        seen.append(sum(ref() is not None for ref in live))   # earlier outputs still alive
        out = _Output()
        live.append(weakref.ref(out))
        return out

    stats = trace_stats.profile(step, 4, log_dir=str(tmp_path), back_to_back=True)
    assert seen == [0, 0, 0, 0] and len(live) == 4
    assert stats.steps == 4


def test_waited_for_profile_calls_each_step_once(tmp_path):
    calls = []
    stats = trace_stats.profile(lambda: calls.append(1), 3, log_dir=str(tmp_path))
    assert len(calls) == 3 and stats.steps == 3
