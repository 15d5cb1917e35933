"""Every op against TransformerEngine's Triton permutation kernels, in one process, on one GPU.

    python3 -m benchmarks.peer --out DIR [--shapes Mixtral,Qwen3] [--calls 10]
    python3 -m benchmarks.peer --summary DIR/peer.json   # rewrite the TARGET lines and the chart

TransformerEngine's PyTorch wrappers (``transformer_engine.pytorch.triton.permutation``,
which need only torch and Triton) run on the same routing problems as our ops (default
configs, no tuning in the process) and as the ``xla`` backend. Kernel times come from three
CUPTI profiles (``benchmarks/kernel_timer.py``), the order of the ops reversed in the
second: each op's time is the sum of every kernel one call launches (XLA's glue included),
median over the calls of all three. Beside it, each op's wall time per call: calls enqueued
back to back and waited for once, as a loop calling the op sees it (host dispatch and launch
gaps included; where it is well above the kernel time, the host sets the pace). "%" is the op's honestly
counted bytes (``benchmarks/cases.py``) per second over a device-to-device copy measured
in the same run (torch ``copy_``, read + write). TE's kernels are autotuned on their first
call (TransformerEngine's own ``triton.autotune``); that happens in the warm-up, outside
the profile.

Writes ``DIR/peer.json``, ``DIR/peer.png`` and ``DIR/peer_summary.txt``, whose
``TARGET`` lines compare, per shape: each op's kernel time with TE's (ours <= TE), with
the ``xla`` backend's, and each backward with its forward (<= 1.1x). ``token_combine.train``
is a training step's combine: the forward as differentiation runs it (it also fills the
row owner table its backward reads) and the backward, against TE's forward and backward.
Each comparison also gives both sides' call-to-call spread (the calls' interquartile range over their median;
a gap smaller than it is within what reruns of the same kernel move) and wall times. A comparison reads
``AT LIMIT`` rather than ``FAIL`` where ours moves its bytes at no less than 97% of the device
copy's rate and trails by less than the larger spread: both sides then run at the memory's
limit, and the gap is within what reruns move (such lines pass in one run and fail in the next).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np

from benchmarks import kernel_timer
from benchmarks.results_io import write_json
from benchmarks.shapes import GPU_SHAPES, OFF_LIST_SHAPES, MoEShape, by_name

OPS = ("make_row_id_map.fwd", "token_dispatch.fwd", "token_dispatch.bwd", "token_combine.fwd",
       "token_combine.bwd", "token_combine.train", "sort_chunks_by_index.fwd", "sort_chunks_by_index.bwd")
BWD_LIMIT = 1.1
AT_LIMIT_PCT = 97.0  # of the device copy's rate: a kernel this close to the copy is at the memory's limit


def te_module():
    """TransformerEngine's PyTorch permutation wrappers, or ``None`` when not importable."""
    try:
        from transformer_engine.pytorch.triton import permutation
    except Exception:  # noqa: BLE001 - absent or broken: the run goes on without the peer
        return None
    return permutation


def _torch(a: np.ndarray):
    import torch
    import ml_dtypes
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to("cuda").to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).to("cuda")


def te_ops(te, p) -> dict[str, Callable[[], Any]]:
    """TE's op for every name in ``OPS``, as zero-argument calls on the problem's data."""
    import torch
    s = p.shape
    T, H, E, n = s.T, s.H, s.E, s.num_out
    inp = _torch(np.asarray(p.inp))
    rm = _torch(np.asarray(p.routing_map))
    probs = _torch(np.asarray(p.probs))
    rid = te.make_row_id_map(rm, T, E)
    permuted, _, pprobs = te.permute_with_mask_map(inp, rid, probs, None, None, T, E, n, H, 0)
    grad_rows = torch.ones_like(permuted)
    grad_pprobs = torch.ones_like(pprobs)
    grad_tok = torch.ones_like(inp)
    split = _torch(np.asarray(p.split_sizes))
    order = _torch(np.asarray(p.sorted_indices))
    sprobs = _torch(np.asarray(p.sort_probs))
    chunk_map = te.make_chunk_sort_map(split, order, n, split.shape[0])

    def dispatch():
        r = te.make_row_id_map(rm, T, E)
        return te.permute_with_mask_map(inp, r, probs, None, None, T, E, n, H, 0)

    def combine_fwd():
        return te.unpermute_with_mask_map(permuted, rid, probs, None, None, T, E, H)

    def combine_bwd():
        return te.unpermute_with_mask_map_bwd_with_merging_probs(grad_tok, rid, permuted, probs, None, T, E, n, H)

    def sort_fwd():
        m = te.make_chunk_sort_map(split, order, n, split.shape[0])
        return te.sort_chunks_by_map(permuted, m, sprobs, n, H, True)

    return {
        "make_row_id_map.fwd": lambda: te.make_row_id_map(rm, T, E),
        "token_dispatch.fwd": dispatch,
        # TE's permute backward: rows summed back per token, probs gathered back.
        "token_dispatch.bwd": lambda: te.unpermute_with_mask_map(grad_rows, rid, None, grad_pprobs, None, T, E, H),
        "token_combine.fwd": combine_fwd,
        "token_combine.bwd": combine_bwd,
        "token_combine.train": lambda: (combine_fwd(), combine_bwd()),
        "sort_chunks_by_index.fwd": sort_fwd,
        "sort_chunks_by_index.bwd": lambda: te.sort_chunks_by_map(permuted, chunk_map, sprobs, n, H, False),
    }


def our_ops(p, backend: str) -> dict[str, tuple[Callable[[], Any], int]]:
    """Our op (on ``backend``) for every name in ``OPS`` and its byte count."""
    import jax
    from benchmarks import cases
    out = {}
    for c in cases.CASES:
        if c.name in OPS:
            built = c.build(p, backend)
            fn = jax.jit(built.fn)
            out[c.name] = ((lambda fn=fn, args=built.args: fn(*args)), built.bytes)
    return out


def copy_op(p) -> tuple[Callable[[], Any], int]:
    import torch
    src = torch.randn(p.shape.num_out, p.shape.H, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * src.numel() * src.element_size()


def measure_shape(shape: MoEShape, te, calls: int, log) -> list[dict]:
    from benchmarks import cases
    p = cases.Problem.make(shape)
    copy_fn, copy_bytes = copy_op(p)
    items: list[tuple[tuple[str, str], Callable[[], Any]]] = [(("copy", "torch"), copy_fn)]
    nbytes: dict[str, int] = {}
    for impl in ("ours", "xla"):
        for name, (fn, b) in our_ops(p, "triton" if impl == "ours" else "xla").items():
            items.append(((name, impl), fn))
            nbytes[name] = b
    if te is not None:
        items += [((name, "te"), fn) for name, fn in te_ops(te, p).items()]
    # Three profiles, the order reversed in the second: no op is always timed before another
    # (ours before TE's in two, after them in one), and each op's median takes all three.
    times = kernel_timer.measure(items, calls=calls, rounds=3)
    walls = kernel_timer.wall_us(items, calls=calls)
    copy_us = times[0].per_call_us()
    copy_bw = copy_bytes / (copy_us * 1e-6)
    rows = []
    for t, wall in zip(times[1:], walls[1:]):
        name, impl = t.label
        us = t.per_call_us()
        bw = nbytes[name] / (us * 1e-6)
        rows.append({"shape": shape.name, "model": shape.model, "T": shape.T, "H": shape.H, "E": shape.E,
                     "k": shape.k, "op": name, "impl": impl, "kernel_us": us, "wall_us": wall, "bytes": nbytes[name],
                     "pct_copy": 100 * bw / copy_bw, "copy_GBps": copy_bw / 1e9, "spread_pct": t.spread_pct(),
                     "kernels_per_call": t.count_per_call(), "kernels": t.by_name()})
        log(f"{shape.name:40s} {name:26s} {impl:5s} {us:9.1f} µs kernel {wall:9.1f} µs wall  "
            f"{100 * bw / copy_bw:6.1f}% of copy")
    return rows


def _spread_and_wall(mine: dict, other: dict) -> str:
    """Both sides' call-to-call spread (interquartile range over median), where measured: a
    gap smaller than these is within what reruns of the same kernel move; and both sides'
    wall time per call, where measured."""
    a, b = mine.get("spread_pct"), other.get("spread_pct")
    text = "" if a is None or b is None else f"; call-to-call spread {a:.1f}% and {b:.1f}%"
    a, b = mine.get("wall_us"), other.get("wall_us")
    return text + ("" if a is None or b is None else f"; wall {a:.1f} and {b:.1f} µs a call")


def _verdict(mine: dict, other: dict) -> str:
    """``PASS`` where ours is at least as fast; ``AT LIMIT`` where it trails, but runs at
    :data:`AT_LIMIT_PCT` or more of the device copy's rate by less than the larger call-to-call
    spread (measured on both sides); else ``FAIL``."""
    ours, theirs = mine["kernel_us"], other["kernel_us"]
    if ours <= theirs:
        return "PASS"
    spreads = [mine.get("spread_pct"), other.get("spread_pct")]
    if (None not in spreads and mine["pct_copy"] >= AT_LIMIT_PCT
            and 100 * (ours - theirs) / theirs <= max(spreads)):
        return "AT LIMIT"
    return "FAIL"


def targets(rows: list[dict]) -> list[str]:
    """One TARGET line per (shape, op) against TE and xla, and per backward against its
    forward. A backward is held to its forward's time per byte moved: the combine backward
    also reads the forward's input rows to form the probability gradient, (2k+1)/(k+1) times
    the forward's bytes at top-k, so its raw time can never be near its forward's (the line
    shows both). Each line also gives both sides' bytes per second over the device copy of
    the same run: a kernel near 100% is at the memory's limit, whatever the other side does."""
    by = {(r["shape"], r["op"], r["impl"]): r for r in rows}
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for op in OPS:
            mine = by.get((shape, op, "ours"))
            if mine is None:
                continue
            ours = mine["kernel_us"]
            for peer in ("te", "xla"):
                other = by.get((shape, op, peer))
                if other is not None:
                    lines.append(f"TARGET {_verdict(mine, other)} {shape} {op}: ours {ours:.1f} µs <= {peer} "
                                 f"{other['kernel_us']:.1f} µs (ratio {other['kernel_us'] / ours:.2f}x; "
                                 f"{mine['pct_copy']:.1f}% and {other['pct_copy']:.1f}% of the device copy"
                                 f"{_spread_and_wall(mine, other)})")
            fwd = by.get((shape, op[:-4] + ".fwd", "ours")) if op.endswith(".bwd") else None
            if fwd:
                per_byte = (ours / mine["bytes"]) / (fwd["kernel_us"] / fwd["bytes"])
                lines.append(f"TARGET {'PASS' if per_byte <= BWD_LIMIT else 'FAIL'} {shape} {op}: time per byte "
                             f"<= {BWD_LIMIT}x forward's ({per_byte:.2f}x; {ours:.1f} µs for "
                             f"{mine['bytes'] / 1e6:.0f} MB, forward {fwd['kernel_us']:.1f} µs for "
                             f"{fwd['bytes'] / 1e6:.0f} MB; {mine['pct_copy']:.1f}% and {fwd['pct_copy']:.1f}% "
                             f"of the device copy)")
    return lines


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = [i for i in ("ours", "te", "xla") if any(r["impl"] == i for r in rows)]
    fig, axes = plt.subplots(len(OPS), 1, figsize=(max(8, 1.3 * len(shapes)), 2.6 * len(OPS)), sharex=True)
    by = {(r["shape"], r["op"], r["impl"]): r for r in rows}

    def pct(s, op, impl, time_key):
        """% of the copy's rate at this row's kernel or wall time (the copy timed by kernels)."""
        r = by.get((s, op, impl))
        return np.nan if r is None or r.get(time_key) is None else r["pct_copy"] * r["kernel_us"] / r[time_key]

    width = 0.8 / len(impls)
    for ax, op in zip(axes, OPS):
        for j, impl in enumerate(impls):
            x = np.arange(len(shapes)) + j * width
            ax.bar(x, [pct(s, op, impl, "kernel_us") for s in shapes], width, label=impl)
            # A lone call's rate, host dispatch included: a tick on the bar where measured.
            ax.scatter(x, [pct(s, op, impl, "wall_us") for s in shapes], marker="_", s=60, color="black",
                       label="wall time" if (op, j) == (OPS[0], 0) else None, zorder=3)
        ax.set_ylabel("% of copy")
        ax.set_title(op, fontsize=9)
        ax.axhline(100, color="gray", lw=0.5)
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1].set_xticks(np.arange(len(shapes)) + 0.4 - width / 2)
    axes[-1].set_xticklabels([s.replace("/", "\n", 1) for s in shapes], fontsize=7)
    fig.suptitle("bytes moved per second over a device copy (higher is better): bars by kernel time, "
                 "ticks by a lone call's wall time")
    fig.tight_layout(rect=(0, 0, 1, 0.985))   # room for the title above the first panel's
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(json_path: str, result: dict) -> None:
    """``result`` to ``json_path`` (``X.json``) and its TARGET lines to ``X_summary.txt`` beside it."""
    write_json(json_path, result)
    with open(json_path[:-len(".json")] + "_summary.txt", "w") as f:
        f.write("\n".join(result["targets"]) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for peer.json, peer.png and peer_summary.txt")
    ap.add_argument("--shapes", default="", help="comma-separated substrings of shape names (default: all)")
    ap.add_argument("--calls", type=int, default=10, help="profiled calls per op in each of the three profiles")
    ap.add_argument("--summary", metavar="PEER_JSON", help="only rewrite the summary (TARGET lines) and the chart of a "
                    "peer.json written earlier, beside it")
    args = ap.parse_args(argv)
    if args.summary:
        with open(args.summary) as f:
            result = json.load(f)
        write_results(args.summary, {**result, "targets": targets(result["rows"])})
        if result["rows"]:
            try:
                plot(result["rows"], args.summary[:-len(".json")] + ".png")
            except ImportError as e:  # the lines are written; only the chart needs matplotlib
                print(f"no chart: {e}")
        return 0
    if not args.out:
        ap.error("--out is required to measure")
    if args.calls < 1:
        ap.error(f"--calls={args.calls} must be at least 1")
    shapes = by_name(args.shapes, GPU_SHAPES + OFF_LIST_SHAPES)   # before any import or measurement
    import jax
    import triton
    os.makedirs(args.out, exist_ok=True)
    te = te_module()
    log_lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_lines.append(msg)

    log(f"peer benchmark on {jax.devices()[0].device_kind}; TransformerEngine kernels: "
        f"{'present' if te else 'absent (not importable)'}")
    rows: list[dict] = []
    t0 = time.monotonic()
    for shape in shapes:
        try:
            rows += measure_shape(shape, te, args.calls, log)
        except Exception:  # one shape failing must not end the run
            log(f"{shape.name}: FAILED\n{traceback.format_exc()}")
    lines = targets(rows)
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "te_present": te is not None, "calls": args.calls,
            "wall_s": time.monotonic() - t0, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_results(os.path.join(args.out, "peer.json"), {"meta": meta, "rows": rows, "targets": lines})
    if rows:
        try:
            plot(rows, os.path.join(args.out, "peer.png"))
        except ImportError as e:  # the numbers are written; only the chart needs matplotlib
            log(f"no chart: {e}")
    for line in lines:
        log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
