"""Expert-parallel MoE layer on the GPUs of this machine, or on N virtual CPU devices.

Each device holds --tokens tokens and E / ep experts (ep = devices / --data); rows cross
devices by an all-to-all (dense: capacity-padded chunks; ragged: exactly the kept rows), the
experts run as grouped GEMMs around the --activation (SwiGLU by default), and the rows come
home by the reverse exchange (see te_jax_perm.parallel.ep_moe_layer). With --data=D the
devices form a [D, ep] mesh: D data-parallel copies of one expert-parallel group, each with
its own tokens, rows exchanged inside a copy, weight gradients summed over the copies.

    python3 examples/moe_expert_parallel.py                      # all GPUs, else 8 CPU devices
    python3 examples/moe_expert_parallel.py --hidden=7168 --experts=256
    python3 examples/moe_expert_parallel.py --data=2             # 2 copies of a 4-device group on 8
    python3 examples/moe_expert_parallel.py --data=2 --fsdp      # and the weights split over the copies
    python3 examples/moe_expert_parallel.py --cpu_devices=4 --backend=interpret --tokens=16 --hidden=32

Before compiling, it estimates the per-device working set and compares it with the
device's memory: a layer that cannot fit exits with a message (status 2) instead of
running out of memory inside a collective, where the other devices would wait forever.
For each all-to-all mode it checks the output and the gradients of x, probs, w_in and w_out
against the single-device reference (on a subset of the tokens at real sizes: the loss
of the checked step counts only those tokens). The last line is PASS or FAIL (exit status
0 or 1). Step and exchange times, and weak scaling over 1, 2, 4, ... devices, are
``python3 -m benchmarks.ep_bench``'s (it takes these flags too).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

from absl import flags

# jax is imported here, but its devices start only in setup(), after --cpu_devices is read.
from te_jax_perm.ops.moe_ffn.reference import ACTIVATIONS
from te_jax_perm.parallel import EPConfig

FLAGS = flags.FLAGS
flags.DEFINE_integer("cpu_devices", 8, "virtual CPU devices to run on when there is no GPU", lower_bound=1)
flags.DEFINE_integer("devices", None, "use the first N devices (default: all)", lower_bound=1)
flags.DEFINE_integer("tokens", None, "tokens per device T (default: 4096 on GPUs, 64 on CPU)", lower_bound=1)
flags.DEFINE_integer("hidden", None, "hidden size H (default: 4096 on GPUs, 64 on CPU)", lower_bound=1)
flags.DEFINE_integer("ffn", None, "expert FFN inner size F (default: 2048 on GPUs, 64 on CPU)", lower_bound=1)
flags.DEFINE_integer("data", 1, "data-parallel copies of the expert-parallel group; the devices form a "
                     "[data, devices / data] mesh (1: one group over every device)", lower_bound=1)
flags.DEFINE_bool("fsdp", False, "split the expert weights along their hidden dimension over the --data axis "
                  "(FSDP): gathered for each step's GEMMs, their gradients reduce-scattered")
flags.DEFINE_integer("experts", None, "routed experts E, a multiple of the expert-parallel group's size "
                     "devices / data (default: 32 on GPUs, 2 per group member on CPU)", lower_bound=1)
flags.DEFINE_enum("activation", EPConfig().activation, list(ACTIVATIONS),
                  "the experts' activation, as moe_ffn names it: silu_glu (SwiGLU) and gelu_glu are gated "
                  "(w_in holds gate and up columns, [E, H, 2F])")
flags.DEFINE_integer("topk", None, "experts per token k (default: 8 on GPUs, 2 on CPU)", lower_bound=1)
flags.DEFINE_enum("dtype", None, ["bfloat16", "float16", "float32"], "token and weight dtype (default: bfloat16 on "
                  "GPUs, float32 on CPU)")
flags.DEFINE_enum("routing", "uniform", ["uniform", "skewed"],
                  "uniform: top-k of random logits; skewed: expert 0 takes every token, the last expert none")
flags.DEFINE_integer("capacity", None, "rows each device may send to each device; rows past it drop "
                     "(default: the worst case, nothing drops)", lower_bound=0)
flags.DEFINE_enum("backend", None, ["triton", "interpret", "xla"], "te_jax_perm kernel backend "
                  "(default: triton on GPUs, xla on CPU)")
flags.DEFINE_enum("gemm", "auto", ["auto", "triton", "interpret", "tokamax", "xla"],
                  "expert grouped GEMM, grouped_matmul's backend: triton (our Triton grouped GEMM, GPU), "
                  "interpret (the same in Triton's CPU interpreter), tokamax (GPUs, needs te_jax_perm[gemm]), "
                  "xla (jax.lax.ragged_dot) or auto (triton on GPUs, else xla)")
flags.DEFINE_enum("a2a", "both", ["dense", "ragged", "both"],
                  "all-to-all: dense (capacity-padded), ragged (exact rows; where the platform supports it) or "
                  "both (ragged only where supported)")
flags.DEFINE_integer("check_tokens", 256, "tokens (over all devices) checked against the single-device "
                     "reference when the whole batch is larger; all tokens when --capacity makes rows drop",
                     lower_bound=1)
flags.DEFINE_float("device_memory_gib", None, "device memory to plan for, in GiB (default: what the device "
                   "reports; CPUs report none, then the check is skipped)")
flags.register_validator("device_memory_gib", lambda v: v is None or v > 0,
                         "--device_memory_gib must be a positive number of GiB")

TOL = {"float32": 2e-3, "bfloat16": 5e-2, "float16": 1e-2}
EXIT_WONT_FIT = 2


@dataclasses.dataclass(frozen=True)
class Sizes:
    n_dev: int
    tokens: int
    hidden: int
    ffn: int
    experts: int
    topk: int
    dtype: str
    capacity: int | None
    data: int = 1
    activation: str = EPConfig().activation
    fsdp: bool = False

    @property
    def ep(self) -> int:
        """Devices of one expert-parallel group."""
        return self.n_dev // self.data

    @property
    def gated(self) -> bool:
        """Whether w_in holds gate and up columns (``[E, H, 2F]``)."""
        return ACTIVATIONS[self.activation][1]

    @property
    def num_out(self) -> int:
        return self.tokens * self.topk

    @property
    def cap(self) -> int:
        """Rows per (source, destination) slot: the worst case unless --capacity is given."""
        return min(self.num_out, self.tokens * self.experts // self.ep) if self.capacity is None else self.capacity


def sizes_from_flags(n_dev: int, on_gpu: bool) -> Sizes:
    pick = lambda v, gpu, cpu: v if v is not None else (gpu if on_gpu else cpu)
    e = pick(FLAGS.experts, 32, 2 * max(1, n_dev // FLAGS.data))
    return Sizes(n_dev, pick(FLAGS.tokens, 4096, 64), pick(FLAGS.hidden, 4096, 64), pick(FLAGS.ffn, 2048, 64), e,
                 pick(FLAGS.topk, 8, 2), pick(FLAGS.dtype, "bfloat16", "float32"), FLAGS.capacity, FLAGS.data,
                 FLAGS.activation, FLAGS.fsdp)


def on_devices(sz: Sizes, n: int) -> Sizes:
    """The same layer per device on ``n`` devices (``n / data`` per expert-parallel group):
    tokens and experts per device kept (weak scaling)."""
    return dataclasses.replace(sz, n_dev=n, experts=sz.experts // sz.ep * (n // sz.data))


def make_mesh(sz: Sizes, devices):
    """The ``[data, ep]`` mesh of ``devices`` (axes ``("data", "ep")``; ``("ep",)`` for one copy)."""
    import numpy as np
    from jax.sharding import Mesh
    if sz.data == 1:
        return Mesh(np.array(devices), ("ep",))
    return Mesh(np.array(devices).reshape(sz.data, sz.ep), ("data", "ep"))


def memory_check(sz: Sizes, modes: list[str], devices) -> tuple[bool, str]:
    from te_jax_perm.parallel.memory import ep_working_set, fits
    ws = max((ep_working_set(tokens=sz.tokens, hidden=sz.hidden, ffn=sz.ffn, experts=sz.experts, ep=sz.ep,
                             capacity=sz.cap, num_out_tokens=sz.num_out, dtype=sz.dtype, a2a=m, gated=sz.gated,
                             fsdp=sz.data if sz.fsdp else 1)
              for m in modes), key=lambda w: w.total)
    return fits(ws, memory_limit(devices[0]))


# -- problem, layer and reference -----------------------------------------------------------------
def make_problem(sz: Sizes, mesh, routing: str, seed: int = 0):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    rng = np.random.default_rng(seed)
    tt = sz.n_dev * sz.tokens
    logits = rng.standard_normal((tt, sz.experts)).astype(np.float32)
    if routing == "skewed":
        logits[:, 0] += 100.0
        logits[:, -1] -= 100.0
    top = np.argpartition(-logits, sz.topk - 1, axis=1)[:, :sz.topk]
    rm = np.zeros((tt, sz.experts), bool)
    np.put_along_axis(rm, top, True, 1)
    shard = NamedSharding(mesh, P(mesh.axis_names))          # tokens over every mesh axis, data major
    # Experts over the group; copied over data, or with --fsdp their H split over it.
    split = "data" if sz.fsdp else None
    w_in_sharding, w_out_sharding = NamedSharding(mesh, P("ep", split)), NamedSharding(mesh, P("ep", None, split))
    probs = jax.device_put(jax.nn.softmax(jnp.asarray(logits), -1), shard)
    dt = jnp.dtype(sz.dtype)
    f_in = 2 * sz.ffn if sz.gated else sz.ffn

    def weights(key):
        k0, k1, k2 = jax.random.split(key, 3)
        x = jax.random.normal(k0, (tt, sz.hidden), dt)
        w_in = (jax.random.normal(k1, (sz.experts, sz.hidden, f_in), dt) / np.sqrt(sz.hidden)).astype(dt)
        w_out = (jax.random.normal(k2, (sz.experts, sz.ffn, sz.hidden), dt) / np.sqrt(sz.ffn)).astype(dt)
        return x, w_in, w_out

    # Made directly in their shards: the full weights never sit on one device.
    x, w_in, w_out = jax.jit(weights, out_shardings=(shard, w_in_sharding, w_out_sharding))(jax.random.PRNGKey(seed))
    return x, jax.device_put(rm, shard), probs, w_in, w_out, rm


def loss_fn(layer):
    import jax.numpy as jnp

    def loss(x, p, w_in, w_out, rm, weights):
        out = layer(x, rm, p, w_in, w_out).astype(jnp.float32)
        return jnp.sum(weights[:, None] * out * out) / x.shape[1], out
    return loss


def checked_rows(sz: Sizes) -> Any:
    """Token indices the check covers: all, or the first few of every device's shard."""
    import numpy as np
    tt = sz.n_dev * sz.tokens
    if sz.capacity is not None or tt <= FLAGS.check_tokens:
        return np.arange(tt)     # drops depend on the whole shard: only the full reference matches
    per = max(1, FLAGS.check_tokens // sz.n_dev)
    return (np.arange(sz.n_dev)[:, None] * sz.tokens + np.arange(per)[None, :]).reshape(-1)


def reference_grads(sz: Sizes, x, p, w_in, w_out, rm_host, rows):
    """Output and gradients of the single-device reference on ``rows`` (everything on device 0)."""
    import jax
    import jax.numpy as jnp
    from te_jax_perm.parallel import reference_moe_layer

    full = len(rows) == sz.n_dev * sz.tokens
    xs, ps, rms = (x, p, jnp.asarray(rm_host)) if full else (x[rows], p[rows], jnp.asarray(rm_host[rows]))
    xs, ps, rms, w_in, w_out = (on_first_device(a) for a in (xs, ps, rms, w_in, w_out))
    if full:
        ref = lambda x, rm, p, a, b: reference_moe_layer(x, rm, p, a, b, ep=sz.ep, data=sz.data,
                                                         num_out_tokens=sz.num_out, capacity=sz.capacity,
                                                         activation=sz.activation)
    else:       # nothing drops: each token's output depends on that token only
        ref = lambda x, rm, p, a, b: reference_moe_layer(x, rm, p, a, b, ep=1, num_out_tokens=len(rows) * sz.topk,
                                                         activation=sz.activation)
    step = jax.jit(jax.value_and_grad(loss_fn(ref), argnums=(0, 1, 2, 3), has_aux=True))
    (l, out), g = step(xs, ps, w_in, w_out, rms, jnp.ones((len(rows),), jnp.float32))
    return l, out, g


def on_first_device(a):
    """A whole copy of ``a`` on the mesh's first device, gathered device to device (not via the host)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    sharding = getattr(a, "sharding", None)
    if isinstance(sharding, NamedSharding):
        rep = jax.device_put(a, NamedSharding(sharding.mesh, P()))      # an all-gather
        return next(s.data for s in rep.addressable_shards if s.device == sharding.mesh.devices.flat[0])
    return jax.device_put(a, jax.devices()[0])


def max_rel(a, b) -> float:
    import numpy as np
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-9))


# -- one configuration ----------------------------------------------------------------------------
def modes_of(devs) -> list[str]:
    """The --a2a modes to run on ``devs``: ragged only where the platform supports it."""
    from te_jax_perm.parallel import ragged_all_to_all_supported
    ragged_ok = ragged_all_to_all_supported(devs) if len(devs) > 1 else False
    return {"dense": ["dense"], "ragged": ["ragged"], "both": ["dense"] + (["ragged"] if ragged_ok else [])}[FLAGS.a2a]


def memory_limit(device) -> int | None:
    """Bytes of device memory to plan for: --device_memory_gib, else what the device reports."""
    from te_jax_perm.parallel.memory import GIB, device_memory_limit
    return int(FLAGS.device_memory_gib * GIB) if FLAGS.device_memory_gib else device_memory_limit(device)


def compiled_step(sz: Sizes, mesh, mode: str, backend: str, args: tuple, limit: int | None) -> tuple[Any, dict]:
    """The layer's training step (value and gradients of x, probs, w_in, w_out) for one all-to-all
    ``mode``, compiled for ``args``, with its compile time and compiled working set; raises
    MemoryError, before anything runs, when that exceeds ``limit`` bytes (a rank out of
    memory would hang the others in the all-to-all)."""
    import jax
    from te_jax_perm.parallel import ep_moe_layer

    gemm = None if FLAGS.gemm == "auto" else FLAGS.gemm
    cfg = EPConfig(num_out_tokens=sz.num_out, capacity=sz.capacity, backend=backend, a2a=mode, gemm=gemm,
                   data_axes=("data",) if sz.data > 1 else (), activation=sz.activation,
                   fsdp_axes=("data",) if sz.fsdp else ())
    layer = lambda x, rm, p, a, b: ep_moe_layer(x, rm, p, a, b, mesh=mesh, cfg=cfg)
    step = jax.jit(jax.value_and_grad(loss_fn(layer), argnums=(0, 1, 2, 3), has_aux=True))
    t0 = time.perf_counter()
    compiled = step.lower(*args).compile()
    info: dict[str, Any] = {"compile_s": time.perf_counter() - t0}
    ma = compiled.memory_analysis()
    if ma is not None and limit:
        need = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes
        info["compiled_bytes_per_device"] = int(need)
        if need > limit:
            raise MemoryError(f"the compiled step needs {need / 2**30:.1f} GiB per device, more than the "
                              f"device's {limit / 2**30:.1f} GiB: not running it (a rank out of memory would "
                              "hang the others in the all-to-all)")
    return compiled, info


def check_config(sz: Sizes, devices, modes: list[str], backend: str) -> dict:
    """Each mode's output and gradients on ``checked_rows`` against the single-device reference."""
    import jax
    import numpy as np

    mesh = make_mesh(sz, devices)
    x, rm, probs, w_in, w_out, rm_host = make_problem(sz, mesh, FLAGS.routing)
    rows = checked_rows(sz)
    res: dict[str, Any] = {"devices": sz.n_dev, **dataclasses.asdict(sz), "cap": sz.cap, "modes": {},
                           "checked_tokens": len(rows)}
    l_ref, out_ref, g_ref = reference_grads(sz, x, probs, w_in, w_out, rm_host, rows)
    mask = np.zeros((sz.n_dev * sz.tokens,), np.float32)
    mask[rows] = 1.0
    args = (x, probs, w_in, w_out, rm, jax.device_put(mask, x.sharding))
    for mode in modes:
        compiled, r = compiled_step(sz, mesh, mode, backend, args, memory_limit(devices[0]))
        (l, out), g = compiled(*args)
        # Weight gradients on the experts the checked tokens use most: not tens of GiB to the host.
        q = np.sort(np.argsort(-rm_host[rows].sum(0), kind="stable")[:8])
        r["errors"] = {"loss": max_rel(l, l_ref), "out": max_rel(out[rows], out_ref)}
        for name, a, b, idx in (("dx", g[0], g_ref[0], rows), ("dprobs", g[1], g_ref[1], rows),
                                ("dw_in", g[2][q], g_ref[2][q], None), ("dw_out", g[3][q], g_ref[3][q], None)):
            r["errors"][name] = max_rel(a if idx is None else a[idx], b)
        del g, out
        r["ok"] = all(np.isfinite(v) and v <= TOL.get(sz.dtype, 5e-2) for v in r["errors"].values())
        r["checked_experts"] = q.tolist()
        res["modes"][mode] = r
    return res


def print_config(res: dict) -> None:
    tol = TOL.get(res["dtype"], 5e-2)
    for mode, r in res["modes"].items():
        print(f"[{res['devices']} devices, a2a={mode}] compile {r['compile_s']:.1f} s"
              + (f", compiled step needs {r['compiled_bytes_per_device'] / 2**30:.1f} GiB per device"
                 if "compiled_bytes_per_device" in r else ""))
        print(f"  vs single-device reference on {res['checked_tokens']} tokens: max rel err "
              + ", ".join(f"{n} {v:.1e}" for n, v in r["errors"].items())
              + f" (tol {tol:.0e}) -> {'ok' if r['ok'] else 'MISMATCH'}")


@dataclasses.dataclass(frozen=True)
class Run:
    """What the flags and the machine decide: the devices, sizes, all-to-all modes and backend."""
    devices: list
    sz: Sizes
    modes: list[str]
    backend: str
    on_gpu: bool


def setup(counts_of=lambda n: []) -> Run | int:
    """The :class:`Run` of the flags, after the memory check of all devices and of each
    device count ``counts_of(n)`` (fewer devices at the same sizes per device); an exit
    status, with the reason printed, where the layer cannot run."""
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in xla_flags:  # CPU platform only; before start-up
        os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={FLAGS.cpu_devices}".strip()
    import jax

    if jax.default_backend() == "cpu":
        # The check compares two matmul decompositions in float32; keep it exact.
        jax.config.update("jax_default_matmul_precision", "highest")
    if FLAGS.devices and FLAGS.devices > len(jax.devices()):
        print(f"--devices={FLAGS.devices}, but there are {len(jax.devices())} {jax.default_backend()} devices; "
              f"expected at most {len(jax.devices())}")
        return 1
    devs = jax.devices()[:FLAGS.devices] if FLAGS.devices else jax.devices()
    on_gpu = devs[0].platform == "gpu"
    backend = FLAGS.backend or ("triton" if on_gpu else "xla")
    if FLAGS.data < 1 or len(devs) % FLAGS.data:
        print(f"--data={FLAGS.data} does not divide the {len(devs)} devices into equal expert-parallel groups")
        return 1
    if FLAGS.fsdp and FLAGS.data < 2:
        print("--fsdp splits the weights over the --data axis: give --data=2 or more")
        return 1
    sz = sizes_from_flags(len(devs), on_gpu)
    if sz.experts % sz.ep:
        print(f"--experts={sz.experts} is not a multiple of the expert-parallel group's {sz.ep} devices")
        return 1
    if sz.topk > sz.experts:
        print(f"--topk={sz.topk} is more than the {sz.experts} experts; expected at most {sz.experts}")
        return 1
    if sz.fsdp and sz.hidden % sz.data:
        print(f"--hidden={sz.hidden} does not split into the --data={sz.data} pieces --fsdp cuts each weight into; "
              f"expected a multiple of {sz.data}")
        return 1
    modes = modes_of(devs)
    print(f"{jax.default_backend()} ({devs[0].device_kind}) x{sz.n_dev}"
          + (f" as {sz.data} data copies of {sz.ep}" if sz.data > 1 else "")
          + (" (weights split over them)" if sz.fsdp else "")
          + f": E={sz.experts} ({sz.experts // sz.ep} per device), top-{sz.topk}, T={sz.tokens} per device, "
          f"H={sz.hidden}, F={sz.ffn}, {sz.activation}, {sz.dtype}, capacity {sz.cap}, backend {backend}, "
          f"routing {FLAGS.routing}; a2a modes: {modes}")
    for n in list(counts_of(sz.n_dev)) + [sz.n_dev]:
        ok, msg = memory_check(on_devices(sz, n), modes if n > sz.data else ["dense"], devs)
        print(f"memory check ({n} device{'s' if n > 1 else ''}): {msg}")
        if not ok:
            print("WON'T FIT: not compiling. Try fewer --tokens, a smaller --hidden/--ffn, fewer --experts per "
                  "device, or a --capacity (rows past it drop).")
            return EXIT_WONT_FIT
    return Run(devs, sz, modes, backend, on_gpu)


def main(argv: list[str]) -> int:
    del argv
    run = setup()
    if isinstance(run, int):
        return run
    try:
        res = check_config(run.sz, run.devices, run.modes, run.backend)
    except MemoryError as e:
        print(f"WON'T FIT: {e}")
        return EXIT_WONT_FIT
    print_config(res)
    ok = all(r["ok"] for r in res["modes"].values())
    if not run.on_gpu and run.backend != "interpret":
        print("hint: --backend=interpret runs te_jax_perm's Triton kernels on the CPU interpreter "
              "(slow: try it with --tokens=16 --hidden=32 --cpu_devices=4)")
    print(f"{'PASS' if ok else 'FAIL'}: expert-parallel layer on {run.sz.n_dev} {run.devices[0].platform} devices"
          + (f" ({run.sz.data} data copies)" if run.sz.data > 1 else "") + ", "
          f"a2a {'+'.join(run.modes)}, backend {run.backend}, vs the single-device reference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from te_jax_perm import cli
    cli.run(main)
