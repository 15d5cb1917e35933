"""An MoE layer trained data- and FSDP-parallel: tokens split over every device, expert
weights split the way FSDP keeps parameters.

The batch's tokens are split over the mesh axes ("data", "fsdp"); each expert weight is
split along its hidden dimension over "fsdp". ``te_jax_perm.moe_ffn`` runs each token
shard's layer on its own tokens (its row-id map, both grouped GEMMs, the combine), with
no collective in the forward but the weights' gather. In the backward the weight gradients
are summed over the token shards by a reduce-scatter over "fsdp" (half an all-reduce's bytes),
plus an all-reduce of the scattered pieces over "data", and come back split like the
weights, ready for the update.

    python3 examples/moe_fsdp.py                    # all GPUs (else 8 CPU devices), all FSDP
    python3 examples/moe_fsdp.py --data=2           # 2-way data x (devices / 2)-way FSDP
    python3 examples/moe_fsdp.py --hidden=4096 --ffn=1536 --experts=128 --topk=8 --dtype=bfloat16

It checks one SGD step (loss and updated weights) against the same step on one device,
prints the collectives of the compiled step and the time of a few more steps. The last line
is PASS or FAIL (exit status 0 or 1).
"""
from __future__ import annotations

import os
import sys
import time

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("cpu_devices", 8, "virtual CPU devices to run on when there is no GPU", lower_bound=1)
flags.DEFINE_integer("data", 1, "size of the data axis; the FSDP axis takes the rest of the devices",
                     lower_bound=1)
flags.DEFINE_integer("tokens", 32, "tokens per device", lower_bound=1)
flags.DEFINE_integer("hidden", 64, "hidden size H (divisible by the FSDP axis)", lower_bound=1)
flags.DEFINE_integer("ffn", 32, "expert FFN inner size F", lower_bound=1)
flags.DEFINE_integer("experts", 8, "routed experts E", lower_bound=1)
flags.DEFINE_integer("topk", 2, "experts per token k (at most --experts)", lower_bound=1)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "token and weight dtype")
flags.DEFINE_enum("backend", None, ["triton", "xla"], "te_jax_perm backend (default: triton on GPUs, xla on CPU)")
flags.DEFINE_integer("steps", 3, "timed steps after the checked one", lower_bound=1)
flags.DEFINE_float("lr", 0.5, "SGD learning rate")

TOL = {"float32": 1e-4, "bfloat16": 3e-2}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def main(argv: list[str]) -> int:
    del argv
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in xla_flags:  # CPU platform only; before start-up
        os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={FLAGS.cpu_devices}".strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import te_jax_perm

    if jax.default_backend() == "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")   # an exact float32 check
    devs = jax.devices()
    n, data = len(devs), FLAGS.data
    fsdp = n // data if n % data == 0 else 0
    if not fsdp:
        print(f"--data={data} does not divide the {n} devices; expected a divisor of {n}")
        return 1
    if FLAGS.hidden % fsdp:
        print(f"--hidden={FLAGS.hidden} does not divide into the FSDP axis's {fsdp} pieces (devices / --data = "
              f"{n} / {data}); expected a multiple of {fsdp}")
        return 1
    if FLAGS.topk > FLAGS.experts:
        print(f"--topk={FLAGS.topk} is more than the {FLAGS.experts} --experts; expected at most {FLAGS.experts}")
        return 1
    mesh = Mesh(np.array(devs).reshape(data, fsdp), ("data", "fsdp"))
    backend = FLAGS.backend or ("triton" if devs[0].platform == "gpu" else "xla")
    t, h, f, e, k = n * FLAGS.tokens, FLAGS.hidden, FLAGS.ffn, FLAGS.experts, FLAGS.topk
    dt = jnp.dtype(FLAGS.dtype)
    print(f"{jax.default_backend()} ({devs[0].device_kind}) x{n}: mesh data={data} x fsdp={fsdp}, T={t} "
          f"({FLAGS.tokens} per device), H={h}, F={f}, E={e}, top-{k}, {FLAGS.dtype}, backend {backend}")

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    top = np.argsort(-logits, axis=1)[:, :k]
    rm = np.zeros((t, e), bool)
    np.put_along_axis(rm, top, True, 1)
    probs = np.where(rm, np.exp(logits), 0.0)
    probs /= probs.sum(axis=1, keepdims=True)
    batch = (rng.standard_normal((t, h)), rm, probs, rng.standard_normal((t, h)))
    batch = tuple(jnp.asarray(b, dt if b.dtype == np.float64 else b.dtype) for b in batch)
    params = {"w_in": jnp.asarray(rng.standard_normal((e, h, 2 * f)) / np.sqrt(h), dt),
              "w_out": jnp.asarray(rng.standard_normal((e, f, h)) / np.sqrt(f), dt)}

    def loss_fn(params, x, rm, probs, y):
        out = te_jax_perm.moe_ffn(x, rm, probs, params["w_in"], params["w_out"], x.shape[0] * k, backend=backend)
        return jnp.mean(jnp.square(out.astype(jnp.float32) - y.astype(jnp.float32)))

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        return loss, jax.tree.map(lambda w, g: (w - FLAGS.lr * g).astype(w.dtype), params, grads)

    # FSDP's layout: each weight split along its hidden dimension; the tokens over every device.
    split = {"w_in": NamedSharding(mesh, P(None, "fsdp", None)), "w_out": NamedSharding(mesh, P(None, None, "fsdp"))}
    tokens = NamedSharding(mesh, P(("data", "fsdp")))
    sharded_step = jax.jit(step, out_shardings=(NamedSharding(mesh, P()), split))
    p_sharded = jax.device_put(params, split)
    b_sharded = jax.device_put(batch, tokens)
    hlo = sharded_step.lower(p_sharded, b_sharded).compile().as_text()
    found = {c: hlo.count(f" {c}(") + hlo.count(f" {c}-start(") for c in COLLECTIVES}
    print("collectives in the step:", ", ".join(f"{c} x{m}" for c, m in found.items() if m) or "none")

    loss, new = sharded_step(p_sharded, b_sharded)
    ref_loss, ref_new = jax.jit(step)(jax.device_put(params, devs[0]), jax.device_put(batch, devs[0]))
    errs = {"loss": abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-6)}
    for name in params:
        got, want = np.asarray(new[name], np.float32), np.asarray(ref_new[name], np.float32)
        errs[name] = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))
        if new[name].sharding.spec != split[name].spec:
            print(f"{name} came back as {new[name].sharding.spec}; expected {split[name].spec}")
            errs[name] = float("inf")
    print("relative error vs one device: " + ", ".join(f"{n} {v:.1e}" for n, v in errs.items()))

    p = new
    jax.block_until_ready(sharded_step(p, b_sharded))  # warm
    t0 = time.perf_counter()
    for _ in range(FLAGS.steps):
        loss, p = sharded_step(p, b_sharded)
    jax.block_until_ready(p)
    if FLAGS.steps:
        print(f"{FLAGS.steps} steps: {(time.perf_counter() - t0) / FLAGS.steps * 1e3:.2f} ms a step, "
              f"loss {float(ref_loss):.4f} -> {float(loss):.4f}")
    ok = all(v <= TOL[FLAGS.dtype] for v in errs.values())
    print(f"{'PASS' if ok else 'FAIL'}: moe_ffn data x FSDP parallel on {n} {devs[0].platform} devices vs one device")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from te_jax_perm import cli
    cli.run(main)
