"""Expert-parallel MoE layer on all GPUs of this machine, or on N virtual CPU devices.

    python3 examples/moe_expert_parallel.py            # all GPUs, else 8 virtual CPU devices
    python3 examples/moe_expert_parallel.py --cpu-devices 4

Checks the output and gradients against the dense single-device reference, prints the
per-device routed-row counts and the step time, and ends with PASS or FAIL.
"""
import argparse
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--cpu-devices", type=int, default=8)
ap.add_argument("--tokens", type=int, default=256, help="tokens per device")
ap.add_argument("--hidden", type=int, default=256)
ap.add_argument("--ffn", type=int, default=512)
ap.add_argument("--experts-per-device", type=int, default=2)
ap.add_argument("--topk", type=int, default=2)
args = ap.parse_args()
if "XLA_FLAGS" not in os.environ:  # only takes effect for the CPU platform
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from te_jax_perm.parallel import EPConfig, ep_moe_layer, reference_moe_layer  # noqa: E402


def main() -> int:
    devs = jax.devices()
    ep, t, h, f, k = len(devs), args.tokens, args.hidden, args.ffn, args.topk
    e = ep * args.experts_per_device
    mesh = Mesh(np.array(devs), ("ep",))
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((ep * t, e))
    top = np.argsort(-logits, 1)[:, :k]
    rm = np.zeros((ep * t, e), bool)
    np.put_along_axis(rm, top, True, 1)
    probs = jnp.asarray(jax.nn.softmax(jnp.asarray(logits), -1), jnp.float32)
    x = jnp.asarray(rng.standard_normal((ep * t, h)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((e, h, f)) / np.sqrt(h), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, f, h)) / np.sqrt(f), jnp.float32)
    cfg = EPConfig(num_out_tokens=t * k)
    layer_fn = lambda x, p, a, b: ep_moe_layer(x, rm, p, a, b, mesh=mesh, cfg=cfg)
    ref_fn = lambda x, p, a, b: reference_moe_layer(x, rm, p, a, b, ep=ep, num_out_tokens=t * k)
    layer, ref = jax.jit(layer_fn), jax.jit(ref_fn)
    loss = lambda fn: jax.jit(jax.grad(lambda *a: (fn(*a) ** 2).sum(), argnums=(0, 1, 2, 3)))

    print(f"{jax.default_backend()}: ep={ep} devices, E={e}, top-{k}, T={t}/device, H={h}, F={f}")
    rows_to = rm.reshape(ep, t, ep, e // ep).sum(axis=(1, 3))  # [src, dst]
    for r in range(ep):
        print(f"  device {r}: sends {rows_to[r].tolist()} rows, receives {int(rows_to[:, r].sum())}")

    out = layer(x, probs, w1, w2).block_until_ready()
    want = ref(x, probs, w1, w2)
    g, gr = loss(layer_fn)(x, probs, w1, w2), loss(ref_fn)(x, probs, w1, w2)
    tol = 2e-3
    errs = {"out": float(jnp.abs(out - want).max() / (jnp.abs(want).max() + 1e-9))}
    for n, a, b in zip(("dx", "dprobs", "dw1", "dw2"), g, gr):
        errs[n] = float(jnp.abs(a - b).max() / (jnp.abs(b).max() + 1e-9))
    for n, v in errs.items():
        print(f"  max rel err {n:7s} {v:.2e}")

    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        layer(x, probs, w1, w2).block_until_ready()
        times.append(time.perf_counter() - t0)
    print(f"  forward step: median {np.median(times) * 1e3:.2f} ms (min {min(times) * 1e3:.2f}, "
          f"max {max(times) * 1e3:.2f}) over {len(times)} runs")
    ok = all(v < tol for v in errs.values())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
