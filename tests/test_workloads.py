"""The one generator of routing problems (te_jax_perm.workloads) that the autotuner, the
benchmarks and the tests draw from: each skew routes as it says."""
import numpy as np
import pytest

from te_jax_perm.workloads import topk_routing


@pytest.mark.parametrize("T, E, k", [(64, 8, 2), (64, 4, 3), (33, 5, 5), (16, 1, 1)])
@pytest.mark.parametrize("skew", ["uniform", "hot", "empty", "all_one"])
def test_each_skew_routes_every_token_to_k_experts_as_it_says(T, E, k, skew):
    rm, probs = topk_routing(np.random.default_rng(0), T, E, k, skew)
    assert rm.shape == (T, E) and rm.dtype == bool and (rm.sum(axis=1) == k).all()
    np.testing.assert_allclose(probs.sum(axis=1), 1, rtol=1e-6)
    assert ((probs > 0) == rm).all(), "probs outside the routed experts, or a routed expert without one"
    per_expert = rm.sum(axis=0)
    if skew == "hot":
        assert per_expert[0] >= T // 3, per_expert          # about half of the tokens, every run
    if skew == "empty":
        # Experts past the first max(k, E // 2) take no token, also where 2k > E.
        assert not per_expert[max(k, E // 2):].any(), per_expert
    if skew == "all_one":
        assert rm[:, 0].all(), per_expert


def test_an_unknown_skew_or_k_out_of_range_is_refused():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="all_one"):
        topk_routing(rng, 4, 4, 2, "skew")
    with pytest.raises(ValueError, match="k=5"):
        topk_routing(rng, 4, 4, 5)
