"""The hostile-input tests the GPU driver's ``memcheck_hostile`` step runs under
compute-sanitizer: corrupt maps, non-permutation orders, counts that disagree with the map,
short inputs, overflowing sizes. A module of its own, without flags, so tests can read the
list without defining the driver's flags in their process.

``-k 'not xla'`` with these keeps their kernel-backend runs.
"""

HOSTILE_TESTS = [
    "tests/test_ops_memory_safety.py",
    "tests/test_chunk_sort.py::test_traced_non_permutation_drops_chunks_on_every_backend",
    "tests/test_chunk_sort.py::test_non_injective_map_keeps_the_first_row_per_destination",
    "tests/test_chunk_sort.py::test_zero_rows_give_zero_size_results",
    "tests/test_permute.py::test_row_owner_kernel_matches_its_reference_on_hostile_maps",
    "tests/test_permute.py::test_permute_ignores_counts_that_disagree_with_the_map",
    "tests/test_permute.py::test_duplicate_destinations_have_one_writer_on_every_backend",
    "tests/test_permute.py::test_gathers_add_every_entry_of_a_hostile_map",
    "tests/test_dispatch.py::test_zero_tokens_give_zero_size_results",
    "tests/test_grouped_gemm_triton.py::test_values_and_vjp_match_numpy",
]
