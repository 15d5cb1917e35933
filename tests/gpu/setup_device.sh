# Source this on the GPU machine, from the repository root: installs the wheels carried in
# .whl/ (jax-triton for the jax_triton call mode comparisons, the layer's grouped GEMM), sets
# the environment the GPU scripts expect. The default call mode needs no extra wheel.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
# Tests start subprocesses that need the GPU too; don't let the first one take 75% of it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Triton's default cache dir (under $HOME) may not be writable on a shared GPU machine.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
export TE_JAX_PERM_SETUP_DONE=1
