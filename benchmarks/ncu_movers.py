"""DRAM counters of the combine's kernels beside a device copy of the same bytes (Nsight Compute).

    ncu --clock-control none -k regex:"unpermute_weighted_kernel|unpermute_bwd_weighted_kernel|device_copy_kernel" \\
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,\\
dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size \\
        --csv --page raw python3 -m benchmarks.ncu_movers run --shapes SHAPE,... > OUT.csv
    python3 -m benchmarks.ncu_movers summarize OUT.csv

``run`` launches, at each shape (names as in ``benchmarks/shapes.py``), the combine
forward's and backward's main kernels on the operands the ops hand them (default configs),
then our Triton device copy of about the backward's bytes, each twice after compiling.
``summarize`` reads ncu's CSV and prints, per shape, each kernel's time, DRAM bytes read and
written, DRAM throughput as a share of its peak, and three ratios of time per DRAM byte: the
backward's over the forward's and over the copy's, and the copy's over the forward's. The combine backward writes almost as
many bytes as it reads and the forward mostly reads; where the backward moves its bytes as
fast as a copy does, no kernel with its reads and writes can come closer to the forward's
time per byte.
"""
from __future__ import annotations

import argparse
import csv
import sys
from typing import Iterable

KERNELS = {"unpermute_weighted_kernel": "combine.fwd", "unpermute_bwd_weighted_kernel": "combine.bwd",
           "device_copy_kernel": "copy"}
TIME, DRAM_PCT = "gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed"
READ, WRITE = "dram__bytes_read.sum", "dram__bytes_write.sum"
SHAPE_MARK = "ncu_movers shape: "


def run(shape_names: list[str]) -> None:
    """Launches each shape's kernels (see the module doc); ncu records them in order."""
    import jax
    import jax.numpy as jnp
    from benchmarks import cases
    from benchmarks.config_sweep import mover_call
    from benchmarks.copy_baseline import device_copy
    from benchmarks.shapes import GPU_SHAPES, OFF_LIST_SHAPES
    from te_jax_perm.core.launch import configure
    from te_jax_perm.core.triton_backend import triton_call

    shapes = {s.name: s for s in GPU_SHAPES + OFF_LIST_SHAPES}
    # All names checked before the first launch: a typo in the last must not cost ncu's
    # replay of every shape before it.
    if unknown := [n for n in shape_names if n not in shapes]:
        raise SystemExit(f"--shapes: unknown shapes {unknown}; expected names of {sorted(shapes)}")
    for name in shape_names:
        shape = shapes[name]
        problem = cases.Problem.make(shape)
        for case_name, kernel in (("token_combine.fwd", "unpermute_weighted"),
                                  ("token_combine.bwd", "unpermute_bwd_weighted")):
            call, operands = mover_call(problem, case_name, kernel)
            launch = configure(call, call.decl.default_config(call.dims, call.params))
            exe = jax.jit(lambda ops, launch=launch: triton_call(launch, ops)).lower(operands).compile()
            for _ in range(2):
                jax.block_until_ready(exe(operands))
        # The backward reads T + T*k rows and writes T*k: about a copy of T*(2k+1)/2 rows.
        x = jnp.ones((shape.T * shape.H * (2 * shape.k + 1) // 2,), jnp.bfloat16)
        copy = jax.jit(device_copy)
        for _ in range(2):
            jax.block_until_ready(copy(x))
        del problem, x
        # On stdout, where ncu's CSV follows: names the shapes of the CSV's launch groups.
        print(f"{SHAPE_MARK}{name}", flush=True)


def _number(s: str) -> float:
    return float(s.replace(",", ""))


def read_rows(lines: Iterable[str]) -> tuple[list[dict], list[str]]:
    """ncu's ``--csv --page raw`` rows of the kernels in :data:`KERNELS`, in launch order
    (``{"kernel", "us", "dram_pct", "read_bytes", "write_bytes"}``), and the shape names
    :func:`run` printed."""
    lines = list(lines)
    names = [l[len(SHAPE_MARK):].strip() for l in lines if l.startswith(SHAPE_MARK)]
    header, rows = None, []
    for r in csv.reader(l for l in lines if not l.startswith(SHAPE_MARK)):
        if r and r[0] == "ID":
            header = r
        elif header and len(r) == len(header) and r[0].isdigit():
            d = dict(zip(header, r))
            name = d.get("Kernel Name", "")
            kernel = next((k for k in KERNELS if name.startswith(k)), None)
            if kernel:
                # gpu__time_duration is in ns in the raw page.
                rows.append({"kernel": kernel, "us": _number(d[TIME]) / 1e3, "dram_pct": _number(d[DRAM_PCT]),
                             "read_bytes": _number(d[READ]), "write_bytes": _number(d[WRITE])})
    return rows, names


def summarize(rows: list[dict], names: list[str] = ()) -> list[str]:
    """One line per kernel and shape, and the ratios, from :func:`read_rows`. A shape's
    launches run fwd, bwd, copy: each new forward after a copy starts the next shape.
    Kernels launched several times are averaged."""
    groups: list[dict[str, list[dict]]] = []
    for r in rows:
        if not groups or (r["kernel"] == "unpermute_weighted_kernel" and "device_copy_kernel" in groups[-1]):
            groups.append({})
        groups[-1].setdefault(r["kernel"], []).append(r)
    lines = []
    for i, g in enumerate(groups):
        shape = names[i] if i < len(names) else f"shape {i}"
        mean = {k: {f: sum(r[f] for r in rs) / len(rs) for f in ("us", "dram_pct", "read_bytes", "write_bytes")}
                for k, rs in g.items()}
        per_byte = {}
        for k, m in mean.items():
            total = m["read_bytes"] + m["write_bytes"]
            per_byte[k] = m["us"] / total if total else float("nan")
            lines.append(f"{shape}: {KERNELS[k]:12s} {m['us']:9.1f} us, DRAM read {m['read_bytes'] / 1e6:8.1f} MB "
                         f"write {m['write_bytes'] / 1e6:8.1f} MB, {total / m['us'] / 1e6:5.2f} TB/s, "
                         f"{m['dram_pct']:5.1f}% of DRAM peak")
        fwd, bwd, copy = (per_byte.get(k) for k in KERNELS)
        for mine, other, what in ((bwd, fwd, "combine.bwd time per DRAM byte / the forward's"),
                                  (bwd, copy, "combine.bwd time per DRAM byte / the copy's"),
                                  (copy, fwd, "copy time per DRAM byte / the forward's")):
            if mine and other:
                lines.append(f"{shape}: {what}: {mine / other:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.ncu_movers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="launch the kernels (under ncu)")
    r.add_argument("--shapes", required=True, help="comma-separated shape names, e.g. DeepSeek-V3/T8192/H7168/E256/k8")
    s = sub.add_parser("summarize", help="ncu's CSV -> per-kernel DRAM figures and ratios")
    s.add_argument("csv")
    a = ap.parse_args(argv)
    if a.mode == "run":
        run([n for n in a.shapes.split(",") if n])
    else:
        with open(a.csv) as f:
            print("\n".join(summarize(*read_rows(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
