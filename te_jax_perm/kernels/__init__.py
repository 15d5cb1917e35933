"""Triton sources of every kernel the library ships (declared in ``te_jax_perm.ops``).

The memory-safety principle every kernel here follows: **no value of any input, traced or
static, makes a kernel access memory outside its buffers.**

* Every load and store is masked against the sizes the kernel is given for that buffer
  (token count ``T``, expert count ``E``, row counts ``N``/``N_OUT``, row width ``H``).
* Indices read from data (row-id maps, expert ids, routed counts, chunk maps) are bounds-
  checked before use: an out-of-range entry counts as absent (a dropped row, an unmapped
  row), it is never dereferenced, and loops over a data-given count are clamped.
* Sums of data-given sizes are computed in a width that cannot overflow (int64 chunk
  offsets) or saturate where the buffer ends.

What cannot be checked statically therefore has a defined result: entries past the end of
a buffer contribute nothing (a gather reads them as absent, a scatter drops them), and a
chunk sort truncates chunks where the input ends. The checks are masks on values already
in registers; they cost no memory traffic.
"""
