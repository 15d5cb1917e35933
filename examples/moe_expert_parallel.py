"""Expert-parallel MoE layer on all GPUs of this machine, or on N virtual CPU devices.

    python3 examples/moe_expert_parallel.py            # all GPUs (backend triton), else 8 CPU devices
    python3 examples/moe_expert_parallel.py --quick    # smaller GPU problem, 3 timed steps
    python3 examples/moe_expert_parallel.py --cpu-devices 4 --backend interpret --tokens 16 --hidden 32

For each all-to-all mode the platform supports (``dense`` always; ``ragged`` where
``jax.lax.ragged_all_to_all`` works, e.g. on GPUs, not on XLA:CPU) it checks the output and
the gradients of x, probs, w1 and w2 against the dense single-device reference, prints the
per-device row counts and the forward and forward+backward step times, and ends with one
line, PASS or FAIL (exit status 0 or 1).
"""
import argparse
import os
import sys
import time

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--cpu-devices", type=int, default=8, help="virtual CPU devices when there is no GPU")
ap.add_argument("--tokens", type=int, default=None, help="tokens per device (GPU 1024, --quick 256; CPU 128)")
ap.add_argument("--hidden", type=int, default=None, help="GPU 512, --quick 256; CPU 128")
ap.add_argument("--ffn", type=int, default=None, help="GPU 1024, --quick 512; CPU 256")
ap.add_argument("--experts-per-device", type=int, default=4)
ap.add_argument("--topk", type=int, default=2)
ap.add_argument("--routing", choices=("uniform", "skewed"), default="uniform",
                help="skewed: expert 0 takes every token, the last expert none")
ap.add_argument("--capacity", type=int, default=None,
                help="rows per (source, destination) pair; default: no drops at the exchange")
ap.add_argument("--backend", choices=("triton", "interpret", "xla"), default=None,
                help="ops backend (default: triton on GPU, xla on CPU)")
ap.add_argument("--a2a", choices=("dense", "ragged", "both"), default="both",
                help="'both' runs ragged only where the platform supports it")
ap.add_argument("--runs", type=int, default=None, help="timed steps (default 10, --quick 3)")
ap.add_argument("--quick", action="store_true", help="small problem, few timed steps")
args = ap.parse_args()
if "XLA_FLAGS" not in os.environ:  # only takes effect for the CPU platform
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from te_jax_perm.parallel import EPConfig, ep_moe_layer, ragged_all_to_all_supported, reference_moe_layer  # noqa: E402

# The check compares two different matmul decompositions; TF32 would dominate the error.
jax.config.update("jax_default_matmul_precision", "highest")
TOL = 2e-3


def _pick(value, full, quick, cpu):
    # Virtual CPU devices share the host's cores: the CPU default is small.
    if value is not None:
        return value
    return cpu if jax.devices()[0].platform == "cpu" else (quick if args.quick else full)


def _timed(fn, *a, runs):
    jax.block_until_ready(fn(*a))      # compile + warm up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        times.append(time.perf_counter() - t0)
    return np.median(times) * 1e3, min(times) * 1e3


def main() -> int:
    devs = jax.devices()
    on_gpu = devs[0].platform == "gpu"
    backend = args.backend or ("triton" if on_gpu else "xla")
    t, h, f = _pick(args.tokens, 1024, 256, 128), _pick(args.hidden, 512, 256, 128), _pick(args.ffn, 1024, 512, 256)
    runs = args.runs if args.runs is not None else (3 if args.quick else 10)
    k, ep = args.topk, len(devs)
    el = args.experts_per_device
    e = ep * el
    mesh = Mesh(np.array(devs), ("ep",))

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((ep * t, e))
    if args.routing == "skewed":
        logits[:, 0] += 100.0
        logits[:, -1] -= 100.0
    top = np.argsort(-logits, 1)[:, :k]
    rm = np.zeros((ep * t, e), bool)
    np.put_along_axis(rm, top, True, 1)
    probs = jnp.asarray(jax.nn.softmax(jnp.asarray(logits), -1), jnp.float32)
    x = jnp.asarray(rng.standard_normal((ep * t, h)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((e, h, f)) / np.sqrt(h), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, f, h)) / np.sqrt(f), jnp.float32)
    n_out = t * k
    cap = min(n_out, t * el) if args.capacity is None else args.capacity

    ragged_ok = ragged_all_to_all_supported(devs)
    modes = {"dense": ["dense"], "ragged": ["ragged"], "both": ["dense"] + (["ragged"] if ragged_ok else [])}[args.a2a]
    print(f"{jax.default_backend()} ({devs[0].device_kind}): ep={ep} devices, E={e}, top-{k}, T={t}/device, "
          f"H={h}, F={f}, capacity={cap}, ops backend {backend}, routing {args.routing}")
    print(f"ragged_all_to_all {'supported' if ragged_ok else 'not supported'} here; a2a modes run: {modes}")

    # Per-device row counts (before capacity drops): rows_to[src, dst].
    rows_to = rm.reshape(ep, t, ep, el).sum(axis=(1, 3))
    kept_to = np.minimum(rows_to, cap)
    for r in range(ep):
        print(f"  device {r}: routes {rows_to[r].tolist()} rows to devices 0..{ep - 1}; receives "
              f"{int(rows_to[:, r].sum())} rows for experts {r * el}..{r * el + el - 1} "
              f"(per expert {rm.reshape(ep * t, ep, el)[:, r].sum(0).tolist()}), "
              f"{int((rows_to[:, r] - kept_to[:, r]).sum())} dropped at capacity")

    # The routing map is an argument, not a closed-over constant: XLA would otherwise
    # constant-fold the whole routing computation at compile time (minutes at full size).
    rm = jnp.asarray(rm)
    ref_fn = lambda x, p, a, b, m: reference_moe_layer(x, m, p, a, b, ep=ep, num_out_tokens=n_out, capacity=cap)
    grad = lambda fn: jax.jit(jax.value_and_grad(lambda *a: (fn(*a) ** 2).sum(), argnums=(0, 1, 2, 3)))
    want = jax.jit(ref_fn)(x, probs, w1, w2, rm)
    _, g_ref = grad(ref_fn)(x, probs, w1, w2, rm)

    ok = True
    for mode in modes:
        cfg = EPConfig(num_out_tokens=n_out, capacity=args.capacity, backend=backend, a2a=mode)
        layer_fn = lambda x, p, a, b, m: ep_moe_layer(x, m, p, a, b, mesh=mesh, cfg=cfg)
        layer, layer_grad = jax.jit(layer_fn), grad(layer_fn)
        t0 = time.perf_counter()
        out = jax.block_until_ready(layer(x, probs, w1, w2, rm))
        _, g = jax.block_until_ready(layer_grad(x, probs, w1, w2, rm))
        compile_s = time.perf_counter() - t0
        errs = {"out": float(jnp.abs(out - want).max() / (jnp.abs(want).max() + 1e-9))}
        for n, a, b in zip(("dx", "dprobs", "dw1", "dw2"), g, g_ref):
            errs[n] = float(jnp.abs(a - b).max() / (jnp.abs(b).max() + 1e-9))
        mode_ok = all(np.isfinite(v) and v < TOL for v in errs.values())
        ok &= mode_ok
        wire = (ep * cap) if mode == "dense" else None
        print(f"[a2a={mode}] first call (compile) {compile_s:.1f} s; rows on the wire per device: "
              + (f"{wire} (padded to capacity)" if wire else
                 f"{kept_to.sum(1).tolist()} (exactly the kept rows)"))
        print("  max rel err " + ", ".join(f"{n} {v:.1e}" for n, v in errs.items())
              + f"  (tol {TOL:.0e}) -> {'ok' if mode_ok else 'MISMATCH'}")
        fwd = _timed(layer, x, probs, w1, w2, rm, runs=runs)
        bwd = _timed(layer_grad, x, probs, w1, w2, rm, runs=runs)
        print(f"  step time over {runs} runs: forward median {fwd[0]:.2f} ms (min {fwd[1]:.2f}); "
              f"forward+backward median {bwd[0]:.2f} ms (min {bwd[1]:.2f})")
    print(f"{'PASS' if ok else 'FAIL'}: expert-parallel layer on {ep} {jax.default_backend()} devices, "
          f"a2a {'+'.join(modes)}, backend {backend}, vs the single-device reference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
