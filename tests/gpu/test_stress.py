"""The unsynchronised alternating-shape stress (tests/gpu/stress.py), full sweep, ``triton``.

Its harness is tested on the CPU in tests/test_benchmarks_smoke.py (everything under
tests/gpu/ is skipped off the GPU).
"""
import pytest

from tests.gpu import stress


@pytest.mark.gpu
def test_stress_triton_alternating_shapes_dtypes_align():
    rep = stress.run_stress("triton", n_cases=40, passes=4, small=False)
    print(rep.line())
    assert rep.calls >= 100, rep.line()
    assert not rep.failures, "\n".join(rep.failures[:20])
