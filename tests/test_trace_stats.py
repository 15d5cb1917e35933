"""The profiler helper of the benchmarks (benchmarks/trace_stats.py)."""
from benchmarks import trace_stats
from tests.live_outputs import step_probe


def test_back_to_back_profile_keeps_one_call_live(tmp_path):
    """Enqueued back to back, every call's outputs are dropped before the next call: a
    profile that kept them all would hold six steps' weight gradients at once (135 GB at
    DeepSeek-V3's layer)."""
    step, seen = step_probe()
    stats = trace_stats.profile(step, 4, log_dir=str(tmp_path), back_to_back=True)
    assert seen == [0, 0, 0, 0]
    assert stats.steps == 4


def test_waited_for_profile_calls_each_step_once(tmp_path):
    calls = []
    stats = trace_stats.profile(lambda: calls.append(1), 3, log_dir=str(tmp_path))
    assert len(calls) == 3 and stats.steps == 3


def test_union_counts_overlapping_time_once():
    assert trace_stats.union_ns([]) == 0
    assert trace_stats.union_ns([(0, 10), (20, 30)]) == 20                 # apart
    assert trace_stats.union_ns([(20, 30), (0, 10), (5, 25)]) == 30        # chained overlaps, any order
    assert trace_stats.union_ns([(0, 100), (10, 20), (30, 40)]) == 100     # nested


class _Event:
    def __init__(self, name, start, end):
        self.name, self.start_ns, self.end_ns, self.duration_ns = name, start, end, end - start


class _Line:
    def __init__(self, name, events):
        self.name, self.events = name, events


class _Plane:
    def __init__(self, name, lines):
        self.name, self.lines = name, lines


def test_parse_reports_kernels_that_ran_at_once_on_two_streams(monkeypatch):
    """Two streams whose kernels overlap by 30 ns: the kernel time counts the overlap twice,
    the busy time once; a gap inside one stream is still reported."""
    import jax.profiler

    planes = [_Plane("/device:GPU:0", [
        _Line("Stream #1", [_Event("dgrad", 0, 100), _Event("add", 150, 160)]),
        _Line("Stream #2", [_Event("wgrad", 70, 120)]),
    ]), _Plane("/host:CPU", [_Line("python", [_Event("cuLaunchKernel", 0, 1)])])]

    class _Data:
        @staticmethod
        def from_file(path):
            return type("D", (), {"planes": planes})()

    monkeypatch.setattr(jax.profiler, "ProfileData", _Data)
    stats = trace_stats.parse("unused.xplane.pb", steps=1)
    assert stats.kernel_us_per_step * 1e3 == 160                    # 100 + 10 + 50
    assert stats.busy_ns == 130                                     # [0, 120) and [150, 160)
    assert stats.span_ns == 160                                     # 30 ns of it idle
    assert stats.kernel_launches == 1 and stats.gaps[0] == (0.05, "dgrad", "add")
