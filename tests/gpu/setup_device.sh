# Source this on the GPU machine: installs the carried jax-triton wheel (the image lacks it).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
# Tests start subprocesses that need the GPU too; don't let the first one take 75% of it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Triton's default cache dir (under $HOME) may not be writable on a shared GPU machine.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
