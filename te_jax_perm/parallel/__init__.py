"""Expert parallelism on JAX's SPMD machinery: an MoE layer under ``shard_map`` over an
``ep`` mesh axis, and its single-device reference with the same drop rules."""
from te_jax_perm.parallel.a2a_support import ragged_all_to_all_supported
from te_jax_perm.parallel.ep_moe import EPConfig, ep_moe_layer, ep_moe_local
from te_jax_perm.parallel.reference import reference_moe_layer

__all__ = ["EPConfig", "ep_moe_layer", "ep_moe_local", "ragged_all_to_all_supported", "reference_moe_layer"]
