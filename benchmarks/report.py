"""Derived figures (% of copy bandwidth, speedup over xla, whole-layer cost), the issue's
targets, the one-line summaries, and the chart."""
from __future__ import annotations

from typing import Any, Iterable

LAYER_PARTS = (("token_dispatch", "fwd"), ("token_dispatch", "bwd"), ("token_combine", "fwd"), ("token_combine", "bwd"))
FWD_TARGETS = {"token_dispatch": 90.0, "sort_chunks_by_index": 90.0, "token_combine": 85.0}
BWD_WITHIN = 0.10          # backward bandwidth >= (1 - this) * forward bandwidth
MAP_FRACTION = 0.10        # make_row_id_map time <= this * dispatch fwd time (T=16384, E=256, H=7168)
LAYER_SPEEDUP = 3.0
LAYER_MODELS = ("DeepSeek-V3", "Qwen3-235B-A22B")


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
    return {"copy_bandwidth_GBps": copy_bw, "layer": layer,
            "targets": _targets(ok, shapes, layer, kernel_backend, on_gpu)}


def _targets(ok: list[dict], shapes: list[str], layer: list[dict], kb: str, on_gpu: bool) -> list[dict]:
    out = []

    def add(name: str, shape: str, value: float | None, threshold: float, higher_is_better: bool = True):
        passed = None if value is None else (value >= threshold if higher_is_better else value <= threshold)
        out.append({"target": name, "shape": shape, "value": value, "threshold": threshold, "pass": passed,
                    "binding": on_gpu})

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
        if m is not None and d is not None and m["E"] == 256 and (m["T"] == 16384 or not on_gpu):
            add(f"make_row_id_map time / dispatch fwd time <= {MAP_FRACTION:g}", s,
                m["median_s"] / d["median_s"], MAP_FRACTION, higher_is_better=False)
    for entry in layer:
        if any(entry["shape"].startswith(mdl + "/") for mdl in LAYER_MODELS) or not on_gpu:
            add(f"layer (dispatch+combine, fwd+bwd) speedup vs xla >= {LAYER_SPEEDUP:g}", entry["shape"],
                entry["speedup_vs_xla"], LAYER_SPEEDUP)
    return out


def summary_lines(result: dict) -> list[str]:
    lines = [f"copy bandwidth (best of xla / triton copy) per shape, GB/s: "
             + ", ".join(f"{s}={v:.0f}" for s, v in result["copy_bandwidth_GBps"].items())]
    for e in result["layer"]:
        lines.append(f"LAYER {e['shape']:<34} kernel {e['kernel_s'] * 1e3:8.3f} ms  xla {e['xla_s'] * 1e3:8.3f} ms"
                     f"  speedup {e['speedup_vs_xla']:.2f}x")
    for t in result["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "MISSING"}[t["pass"]]
        val = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        tag = "" if t["binding"] else " (cpu smoke: not binding)"
        lines.append(f"TARGET {verdict:<7} {t['target']:<62} {t['shape']:<34} value={val}{tag}")
    rows = result["results"]
    n_ok = sum(r["status"] == "ok" for r in rows)
    n_err = sum(r["status"].startswith("error") for r in rows)
    n_skip = sum(r["status"].startswith("skipped") for r in rows)
    tp = [t["pass"] for t in result["targets"]]
    lines.append(f"BENCH SUMMARY: {n_ok} measured, {n_err} errors, {n_skip} skipped; targets "
                 f"{tp.count(True)} pass, {tp.count(False)} fail, {tp.count(None)} missing; "
                 f"wall {result['meta']['wall_s']:.0f}s on {result['meta']['device']}")
    return lines


def plot(result: dict, path: str) -> None:
    """Two panels: % of copy bandwidth per op (kernel backend) and speedup over xla."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    kb = result["meta"]["kernel_backend"]
    rows = [r for r in result["results"] if r["status"] == "ok" and r["backend"] == kb and r["op"] != "copy"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    series = list(dict.fromkeys(f"{r['op']}.{r['direction']}" for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.6 * len(shapes) + 3), 9), constrained_layout=True)
    width = 0.8 / max(1, len(series) + 1)
    x = np.arange(len(shapes))
    for panel, (ax, key, ylabel) in enumerate(((axes[0], "pct_copy", "% of copy bandwidth"),
                                               (axes[1], "speedup_vs_xla", "speedup over xla (x)"))):
        names = series + (["layer"] if panel == 1 else [])
        for i, name in enumerate(names):
            vals = []
            for s in shapes:
                if name == "layer":
                    e = next((e for e in result["layer"] if e["shape"] == s), None)
                    vals.append(e["speedup_vs_xla"] if e else np.nan)
                else:
                    r = next((r for r in rows if r["shape"] == s and f"{r['op']}.{r['direction']}" == name), None)
                    vals.append(r.get(key, np.nan) if r else np.nan)
            ax.bar(x + (i - len(names) / 2) * width, vals, width, label=name)
        ax.set_xticks(x, [s.replace("/", "\n", 1) for s in shapes], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        if panel == 0:
            for th, style in ((90, "--"), (85, ":")):
                ax.axhline(th, color="k", linestyle=style, linewidth=0.8)
        else:
            ax.axhline(LAYER_SPEEDUP, color="k", linestyle="--", linewidth=0.8)
            ax.set_yscale("log")
        if shapes:
            ax.legend(fontsize=7, ncol=4)
    meta = result["meta"]
    axes[0].set_title(f"te_jax_perm {kb} vs copy / xla on {meta['device']} (jax {meta['jax']}, "
                      f"triton {meta['triton']}; median of {meta['reps']} chains)", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
