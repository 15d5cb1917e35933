"""Derived figures (% of copy bandwidth, speedup over xla, whole-layer cost), the performance
targets (judged on a GPU only), the one-line summaries, and the chart."""
from __future__ import annotations

from typing import Any, Iterable

from te_jax_perm.workloads import DEEPSEEK_V3, QWEN3_235B

# A training layer's permutation: the combine as a training step runs it (its forward keeps
# the row owners its backward reads, so forward and backward alone would leave that out).
LAYER_PARTS = (("token_dispatch", "fwd"), ("token_dispatch", "bwd"), ("token_combine", "train"))
FWD_TARGETS = {"token_dispatch": 90.0, "sort_chunks_by_index": 90.0, "token_combine": 85.0}
BWD_WITHIN = 0.10          # backward bandwidth >= (1 - this) * forward bandwidth
MAP_FRACTION = 0.10        # make_row_id_map time <= this * dispatch fwd time (T=16384, E=256, H=7168)
LAYER_SPEEDUP = 3.0
LAYER_MODELS = (DEEPSEEK_V3, QWEN3_235B)    # the layer speed-up target holds at these


def one_line(row: dict) -> str:
    head = f"{row['shape']:<34} {row['op'] + '.' + row['direction']:<27} {row['backend']:<9}"
    if row["status"] != "ok":
        return f"{head} {row['status']}"
    return (f"{head} {row['median_s'] * 1e3:9.3f} ms  {row['bandwidth_GBps']:8.1f} GB/s"
            f"  spread {row['spread'] * 100:5.1f}%  n={row['n_chain']}x{row['reps']}")


def _ok(rows: Iterable[dict]) -> list[dict]:
    return [r for r in rows if r["status"] == "ok"]


def _find(rows: list[dict], shape: str, op: str, direction: str, backend: str) -> dict | None:
    return next((r for r in rows if (r["shape"], r["op"], r["direction"], r["backend"]) ==
                 (shape, op, direction, backend)), None)


def derive(rows: list[dict], kernel_backend: str, on_gpu: bool) -> dict[str, Any]:
    """Adds ``pct_copy`` and ``speedup_vs_xla`` to the kernel rows; returns layer costs and targets."""
    ok = _ok(rows)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    copy_bw = {}
    for s in shapes:
        bws = [r["bandwidth_GBps"] for r in ok if r["shape"] == s and r["op"] == "copy"]
        if bws:
            copy_bw[s] = max(bws)
    for r in ok:
        if r["op"] == "copy":
            continue
        if r["shape"] in copy_bw:
            r["pct_copy"] = 100.0 * r["bandwidth_GBps"] / copy_bw[r["shape"]]
        if r["backend"] == kernel_backend:
            x = _find(ok, r["shape"], r["op"], r["direction"], "xla")
            if x is not None:
                r["speedup_vs_xla"] = x["median_s"] / r["median_s"]
    layer = []
    for s in shapes:
        times = {}
        for b in (kernel_backend, "xla"):
            parts = [_find(ok, s, op, d, b) for op, d in LAYER_PARTS]
            if all(parts):
                times[b] = sum(p["median_s"] for p in parts)
        if len(times) == 2:
            layer.append({"shape": s, "kernel_s": times[kernel_backend], "xla_s": times["xla"],
                          "speedup_vs_xla": times["xla"] / times[kernel_backend]})
    # A CPU run is a smoke run: the interpreter's times say nothing about a GPU's, so no verdicts.
    return {"copy_bandwidth_GBps": copy_bw, "layer": layer,
            "targets": _targets(ok, shapes, layer, kernel_backend) if on_gpu else []}


def _targets(ok: list[dict], shapes: list[str], layer: list[dict], kb: str) -> list[dict]:
    out = []

    def add(name: str, shape: str, value: float | None, threshold: float, higher_is_better: bool = True):
        passed = None if value is None else (value >= threshold if higher_is_better else value <= threshold)
        out.append({"target": name, "shape": shape, "value": value, "threshold": threshold, "pass": passed})

    for s in shapes:
        for op, th in FWD_TARGETS.items():
            fwd = _find(ok, s, op, "fwd", kb)
            if fwd is not None or any(r["shape"] == s and r["op"] == op for r in ok):
                add(f"{op}.fwd % of copy bandwidth >= {th:g}", s, fwd and fwd.get("pct_copy"), th)
            bwd = _find(ok, s, op, "bwd", kb)
            if fwd is not None and bwd is not None:
                add(f"{op}.bwd bandwidth / fwd >= {1 - BWD_WITHIN:g}", s,
                    bwd["bandwidth_GBps"] / fwd["bandwidth_GBps"], 1 - BWD_WITHIN)
        m = _find(ok, s, "make_row_id_map", "fwd", kb)
        d = _find(ok, s, "token_dispatch", "fwd", kb)
        if m is not None and d is not None and m["E"] == 256 and m["T"] == 16384:
            add(f"make_row_id_map time / dispatch fwd time <= {MAP_FRACTION:g}", s,
                m["median_s"] / d["median_s"], MAP_FRACTION, higher_is_better=False)
    for entry in layer:
        if any(entry["shape"].startswith(mdl.name + "/") for mdl in LAYER_MODELS):
            add(f"layer (dispatch+combine, fwd+bwd) speedup vs xla >= {LAYER_SPEEDUP:g}", entry["shape"],
                entry["speedup_vs_xla"], LAYER_SPEEDUP)
    return out


SMOKE_NOTE = ("CPU SMOKE RUN: Triton's interpreter vs xla at tiny shapes, to check that the benchmark runs end to "
              "end. The times say nothing about GPU performance; no targets are judged.")


def summary_lines(result: dict) -> list[str]:
    smoke = result["meta"].get("smoke", False)
    lines = [SMOKE_NOTE] if smoke else []
    lines.append("copy bandwidth (best of xla / kernel copy) per shape, GB/s: "
                 + ", ".join(f"{s}={v:.3g}" for s, v in result["copy_bandwidth_GBps"].items()))
    for e in result["layer"]:
        lines.append(f"LAYER {e['shape']:<34} kernel {e['kernel_s'] * 1e3:8.3f} ms  xla {e['xla_s'] * 1e3:8.3f} ms"
                     f"  speedup {e['speedup_vs_xla']:.3g}x")
    for t in result["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "MISSING"}[t["pass"]]
        val = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        lines.append(f"TARGET {verdict:<7} {t['target']:<62} {t['shape']:<34} value={val}")
    rows = result["results"]
    n_ok = sum(r["status"] == "ok" for r in rows)
    n_err = sum(r["status"].startswith("error") for r in rows)
    n_skip = sum(r["status"].startswith("skipped") for r in rows)
    tp = [t["pass"] for t in result["targets"]]
    verdicts = ("targets not judged (CPU smoke run)" if smoke else
                f"targets {tp.count(True)} pass, {tp.count(False)} fail, {tp.count(None)} missing")
    lines.append(f"BENCH SUMMARY: {n_ok} measured, {n_err} errors, {n_skip} skipped; {verdicts}; "
                 f"wall {result['meta']['wall_s']:.0f}s on {result['meta']['device']}")
    return lines


def _fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def is_smoke(meta: dict) -> bool:
    """A run of the interpreter rather than the GPU kernels (older files lack the ``smoke`` flag)."""
    return meta.get("smoke", meta.get("kernel_backend") != "triton")


def plot(result: dict, path: str) -> None:
    """The GPU chart (% of copy bandwidth and speedup over xla) or, for a CPU smoke run, the
    measured times of both backends (the smoke run's ratios would be ~0% bars)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = (_plot_times if is_smoke(result["meta"]) else _plot_ratios)(result, plt)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_ratios(result: dict, plt: Any) -> Any:
    """Two panels over the shapes: % of copy bandwidth per op, then speedup over xla per op and
    for the whole layer; target thresholds as labelled lines; legends beside the panels."""
    import numpy as np
    from matplotlib.ticker import FixedLocator, NullLocator

    meta = result["meta"]
    kb = meta["kernel_backend"]
    rows = [r for r in result["results"] if r["status"] == "ok" and r["backend"] == kb and r["op"] != "copy"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    series = list(dict.fromkeys(f"{r['op']}.{r['direction']}" for r in rows))
    colour = {name: f"C{i}" for i, name in enumerate(series + ["layer"])}
    fig, axes = plt.subplots(2, 1, figsize=(max(10.0, 1.45 * len(shapes) + 5.5), 10), constrained_layout=True)
    x = np.arange(len(shapes))
    labels = [s.replace("/", "\n", 1) for s in shapes]

    def value(s: str, name: str, key: str) -> float:
        if name == "layer":
            e = next((e for e in result["layer"] if e["shape"] == s), None)
            return e["speedup_vs_xla"] if e else np.nan
        r = next((r for r in rows if r["shape"] == s and f"{r['op']}.{r['direction']}" == name), None)
        return r.get(key, np.nan) if r else np.nan

    def bars(ax: Any, names: list[str], key: str) -> dict:
        width = 0.84 / max(1, len(names))
        drawn = {}
        for i, name in enumerate(names):
            drawn[name] = ax.bar(x + (i - (len(names) - 1) / 2) * width, [value(s, name, key) for s in shapes],
                                 width, color=colour[name], label=name,
                                 hatch="//" if name == "layer" else None, edgecolor="white", linewidth=0.3)
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_xlim(-0.55, len(shapes) - 0.45)
        ax.grid(axis="y", alpha=0.3)
        return drawn

    top, bottom = axes
    bars(top, series, "pct_copy")
    top.set_ylabel("% of copy bandwidth (higher is better)")
    top.set_ylim(0, 110)
    ops_at = {th: ", ".join(op.replace("sort_chunks_by_index", "sort").replace("token_", "") for op, t in
                            FWD_TARGETS.items() if t == th) for th in sorted(set(FWD_TARGETS.values()), reverse=True)}
    for (th, ops), style in zip(ops_at.items(), ("--", ":")):
        top.axhline(th, color="black", linestyle=style, linewidth=1.0, label=f"target {th:g}%: {ops} fwd")
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, title=f"op ({kb} backend)",
               title_fontsize=8)

    drawn = bars(bottom, series + ["layer"], "speedup_vs_xla")
    bottom.bar_label(drawn["layer"], fmt="%.1fx", fontsize=7, padding=2)
    bottom.set_yscale("log")
    ticks = [t for t in (0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16) if t <= 1.3 * np.nanmax(
        [value(s, n, "speedup_vs_xla") for s in shapes for n in series + ["layer"]] + [4.0])]
    bottom.yaxis.set_major_locator(FixedLocator(ticks))
    bottom.yaxis.set_minor_locator(NullLocator())
    bottom.set_yticklabels([f"{t:g}x" for t in ticks])
    bottom.set_ylabel("speedup over the xla backend (higher is better)")
    bottom.axhline(1.0, color="grey", linewidth=1.0, label="1x: as fast as xla")
    layer_at = " & ".join(m.name.split("-A")[0] for m in LAYER_MODELS)   # without the active-parameter tag ("-A22B")
    bottom.axhline(LAYER_SPEEDUP, color="black", linestyle="--", linewidth=1.0,
                   label=f"target {LAYER_SPEEDUP:g}x: layer at {layer_at}")
    handles, names = bottom.get_legend_handles_labels()
    keep = [i for i, n in enumerate(names) if n not in series]   # the ops are in the legend above
    bottom.legend([handles[i] for i in keep],
                  ["layer (dispatch+combine,\nfwd+bwd)" if names[i] == "layer" else names[i] for i in keep],
                  fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle(f"te_jax_perm {kb} kernels on {meta['device']}: bandwidth vs the fastest copy, speed vs xla\n"
                 f"jax {meta['jax']}, triton {meta['triton']}; median of {meta['reps']} timed chains per bar",
                 fontsize=10)
    return fig


def _plot_times(result: dict, plt: Any) -> Any:
    """One panel per shape: median time of every op on each backend, log scale, labelled."""
    import numpy as np
    from matplotlib.ticker import FuncFormatter

    meta = result["meta"]
    rows = [r for r in result["results"] if r["status"] == "ok"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows)) or ["(nothing measured)"]
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    names = list(dict.fromkeys(f"{r['op']}.{r['direction']}" for r in rows))
    fig, axes = plt.subplots(len(shapes), 1, figsize=(max(9.0, 1.1 * len(names) + 3), 3.6 * len(shapes) + 1),
                             constrained_layout=True, squeeze=False)
    x = np.arange(len(names))
    width = 0.8 / max(1, len(backends))
    for ax, s in zip(axes[:, 0], shapes):
        for i, b in enumerate(backends):
            t = [next((r["median_s"] for r in rows if r["shape"] == s and r["backend"] == b
                       and f"{r['op']}.{r['direction']}" == n), np.nan) for n in names]
            drawn = ax.bar(x + (i - (len(backends) - 1) / 2) * width, t, width, label=b, color=f"C{i}")
            ax.bar_label(drawn, labels=["" if np.isnan(v) else _fmt_time(v) for v in t], fontsize=7, padding=2)
        ax.set_yscale("log")
        ax.set_ylabel("median time per call (log scale)")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _fmt_time(v)))
        ax.set_title(s, fontsize=9)
        ax.set_xticks(x, [n.replace("_by_", "_\nby_").replace(".", "\n") for n in names], fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi * 8)   # room for the labels
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, title="backend",
                  title_fontsize=8)
    where = "" if meta["device"].lower() == "cpu" else f" on {meta['device']}"
    fig.suptitle(f"CPU smoke run{where}: times only, not a performance measurement\n"
                 f"{meta['kernel_backend']} = Triton's interpreter; jax {meta['jax']}, triton {meta['triton']}",
                 fontsize=10)
    return fig


def main(argv: list[str] | None = None) -> int:
    """Redraws a chart from a saved ``bench.json``."""
    import argparse
    import json
    import os

    p = argparse.ArgumentParser(prog="python3 -m benchmarks.report", description=main.__doc__)
    p.add_argument("json", help="a bench.json written by python3 -m benchmarks.run")
    p.add_argument("--out", default=None, help="PNG to write (default: bench.png beside the JSON)")
    a = p.parse_args(argv)
    with open(a.json) as f:
        result = json.load(f)
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.json)), "bench.png")
    plot(result, out)
    print(out)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
