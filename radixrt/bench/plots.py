"""PNG plots of a ``radixrt bench`` report (the JSON of ``--json-out``).

    radixrt bench ... --json-out r.json --plot-dir docs/img     # while benchmarking
    python -m radixrt.bench.plots r.json --out docs/img          # later, from the JSON

Writes (those the report has data for):

* ``bench_throughput.png``: per workload, each system's throughput relative
  to the transformers ``generate`` loop (its wall time over the system's);
* ``bench_cache.png``: per workload, radixrt's cache hit rate in tokens
  (offline and online) and prompt tokens computed over the ideal, radix
  cache on against off;
* ``bench_online_ttft.png``: online median TTFT, radix cache on against off;
* ``sweep_prefix.png``: wall time and prompt tokens computed as the shared
  prefix grows;
* ``sweep_concurrency.png``: wall time per request and peak KV slots as
  concurrency grows.

matplotlib is an optional dependency (``pip install 'radixrt[bench]'``),
imported only here and only when plotting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Optional

from radixrt.help_format import HelpFormatter

REF = "radixrt"
OFF = "radixrt, cache off"
HF = "transformers generate"
SYSTEM_STYLE = {  # label -> (legend, color)
    REF: ("radixrt (lpm)", "#1f77b4"),
    f"{REF} fcfs": ("radixrt fcfs", "#6baed6"),
    f"{REF} dfs-weight": ("radixrt dfs-weight", "#9ecae1"),
    OFF: ("radix cache off", "#ff7f0e"),
    HF: ("transformers generate", "#7f7f7f"),
}


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("plots need matplotlib: pip install 'radixrt[bench]' (or pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {"figure.dpi": 110, "savefig.dpi": 110, "axes.spines.top": False, "axes.spines.right": False, "font.size": 9}
    )
    return plt


def _key(row: dict) -> str:
    return row["system"].split(" (")[0]


def _row(rows: list[dict], system: str, mode: str = "offline") -> Optional[dict]:
    return next((r for r in rows if _key(r) == system and r["mode"] == mode), None)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not math.isnan(v)


def _subtitle(report: dict) -> str:
    model = os.path.basename(str(report.get("model", "")).rstrip("/"))
    a = report.get("args", {})
    scale = f"scale {a['scale']}, " if a.get("scale") is not None else ""
    return (
        f"{model}, CPU, {report.get('torch_threads', '?')} threads, {scale}"
        f"KV pool {a.get('max_total_tokens')} tokens; ratios from one run"
    )


def plot_throughput(report: dict, out_dir: str, plt: Any) -> Optional[str]:
    wls = [w for w in report["workloads"] if _row(w["rows"], HF)]
    if not wls:
        return None
    systems = [s for s in SYSTEM_STYLE if any(_row(w["rows"], s) for w in wls)]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        xs, ys = [], []
        for j, w in enumerate(wls):
            r, base = _row(w["rows"], s), _row(w["rows"], HF)
            if r and base:
                xs.append(j + (i - (len(systems) - 1) / 2) * width)
                ys.append(base["wall_s"] / r["wall_s"])
        label, color = SYSTEM_STYLE[s]
        bars = ax.bar(xs, ys, width, label=label, color=color)
        if s == REF:
            ax.bar_label(bars, labels=[f"{y:.1f}x" for y in ys], fontsize=8, padding=2)
    ax.axhline(1.0, color="black", lw=0.8, ls=":")
    ax.set_xticks(range(len(wls)), [w["name"] for w in wls])
    ax.set_ylabel("throughput relative to\ntransformers generate (x)")
    ax.set_title("Offline throughput per workload (higher is better)\n" + _subtitle(report), fontsize=9)
    ax.legend(ncol=len(systems), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    fig.tight_layout()
    path = os.path.join(out_dir, "bench_throughput.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_cache(report: dict, out_dir: str, plt: Any) -> Optional[str]:
    wls = [w for w in report["workloads"] if _row(w["rows"], REF)]
    if not wls:
        return None
    names = [w["name"] for w in wls]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = range(len(wls))
    for mode, color, dx in [("offline", "#1f77b4", -0.2), ("online", "#2ca02c", 0.2)]:
        ys = [(_row(w["rows"], REF, mode) or {}).get("cache_hit_rate") for w in wls]
        if not any(_finite(y) for y in ys):
            continue
        bars = a1.bar([i + dx for i in x], [100 * (y or 0) for y in ys], 0.4, label=f"radixrt {mode}", color=color)
        a1.bar_label(bars, labels=[f"{100 * (y or 0):.0f}" for y in ys], fontsize=7, padding=1)
    a1.set_xticks(list(x), names, rotation=30, ha="right")
    a1.set_ylabel("cache hit rate (% of prompt tokens)")
    a1.set_ylim(0, 105)
    a1.set_title("Radix cache hit rate in tokens")
    a1.legend(fontsize=8, frameon=False)
    for label, color, dx in [(REF, "#1f77b4", -0.2), (OFF, "#ff7f0e", 0.2)]:
        ys = [(_row(w["rows"], label) or {}).get("computed_vs_ideal") for w in wls]
        if not any(_finite(y) for y in ys):
            continue
        bars = a2.bar(
            [i + dx for i in x],
            [y or 0 for y in ys],
            0.4,
            color=color,
            label="radix cache on" if label == REF else "radix cache off",
        )
        a2.bar_label(bars, labels=[f"{y:.1f}" if _finite(y) else "" for y in ys], fontsize=7, padding=1)
    a2.axhline(1.0, color="black", lw=0.8, ls=":")
    a2.set_yscale("log")
    a2.set_xticks(list(x), names, rotation=30, ha="right")
    a2.set_ylabel("prompt tokens computed / ideal (log)")
    a2.set_title("Prefill work against a perfect prefix cache (1 = ideal)")
    a2.legend(fontsize=8, frameon=False)
    fig.suptitle(_subtitle(report), fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, "bench_cache.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_online(report: dict, out_dir: str, plt: Any) -> Optional[str]:
    wls = [w for w in report["workloads"] if _row(w["rows"], REF, "online") and _row(w["rows"], OFF, "online")]
    if not wls:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    x = list(range(len(wls)))
    for label, color, dx, name in [(REF, "#1f77b4", -0.2, "radix cache on"), (OFF, "#ff7f0e", 0.2, "radix cache off")]:
        p50 = [_row(w["rows"], label, "online")["p50_ttft_ms"] for w in wls]
        p99 = [_row(w["rows"], label, "online")["p99_ttft_ms"] for w in wls]
        ax.bar([i + dx for i in x], [v if _finite(v) else 0 for v in p50], 0.4, color=color, label=f"{name}: p50")
        ax.scatter(
            [i + dx for i in x],
            [v if _finite(v) else float("nan") for v in p99],
            color=color,
            edgecolor="black",
            marker="v",
            zorder=3,
            label=f"{name}: p99",
        )
    ax.set_yscale("log")
    ax.set_xticks(x, [w["name"] for w in wls])
    ax.set_ylabel("time to first token (ms, log)")
    rate = ", ".join(f"{w['name']} {_row(w['rows'], REF, 'online').get('request_rate', 0):.2f}/s" for w in wls)
    ax.set_title("Online (HTTP server, Poisson arrivals of programs): TTFT\n" + _subtitle(report), fontsize=9)
    ax.legend(ncol=4, fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.text(0.01, 0.01, "arrival rates (programs/s): " + rate, fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = os.path.join(out_dir, "bench_online_ttft.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def _series(rows: list[dict], system: str, key: str, per: Optional[str] = None) -> tuple[list, list]:
    pts = sorted((r["x"], r.get(key)) for r in rows if _key(r) == system)
    xs = [x for x, v in pts if _finite(v)]
    ys = [v for x, v in pts if _finite(v)]
    if per == "request":
        reqs = {r["x"]: r["requests"] for r in rows if _key(r) == system}
        ys = [y / reqs[x] for x, y in zip(xs, ys)]
    return xs, ys


def _sweep_lines(ax: Any, rows: list[dict], key: str, per: Optional[str] = None) -> None:
    for s in (REF, OFF, HF):
        xs, ys = _series(rows, s, key, per)
        if xs:
            label, color = SYSTEM_STYLE[s]
            ax.plot(xs, ys, marker="o", color=color, label=label)
    ax.set_xscale("log", base=2)
    xs = sorted({r["x"] for r in rows})
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.grid(True, which="major", alpha=0.3)


def _plain_log_ticks(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(fmt)


def plot_sweep(report: dict, sweep: dict, out_dir: str, plt: Any) -> str:
    rows = sweep["rows"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    if sweep["kind"] == "prefix":
        n = sweep["params"]["requests"]
        _sweep_lines(a1, rows, "wall_s")
        a1.set_ylabel("wall time (s)")
        a1.set_title(f"{n} requests sharing one prefix: time")
        _sweep_lines(a2, rows, "prompt_tokens_computed", per="request")
        a2.set_ylabel("prompt tokens computed per request")
        a2.set_title("Prefill work per request")
        for a in (a1, a2):
            a.set_xlabel("shared prefix length (tokens)")
        name = "sweep_prefix.png"
    else:
        p = sweep["params"]["concurrency_prefix"]
        _sweep_lines(a1, rows, "wall_s", per="request")
        a1.set_yscale("log")
        _plain_log_ticks(a1)
        a1.set_ylabel("wall time per request (s, log)")
        a1.set_title(f"N requests at once, sharing a {p}-token prefix: cost per request")
        _sweep_lines(a2, [r for r in rows if _key(r) != HF], "peak_kv_slots")
        pool = {**report.get("args", {}), **sweep.get("context", {}).get("args", {})}.get("max_total_tokens")
        if pool:
            a2.axhline(pool, color="black", lw=0.8, ls=":", label=f"KV pool ({pool} slots)")
        a2.set_yscale("log")
        a2.set_ylabel("peak KV slots in use (log)")
        a2.set_title("KV memory")
        for a in (a1, a2):
            a.set_xlabel("concurrent requests")
        name = "sweep_concurrency.png"
    a1.legend(fontsize=8, frameon=False)
    a2.legend(fontsize=8, frameon=False)
    fig.suptitle(_subtitle({**report, **sweep.get("context", {})}), fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_report(report: dict, out_dir: str) -> list[str]:
    plt = _plt()
    os.makedirs(out_dir, exist_ok=True)
    paths = [plot_throughput(report, out_dir, plt), plot_cache(report, out_dir, plt), plot_online(report, out_dir, plt)]
    paths += [plot_sweep(report, s, out_dir, plt) for s in report.get("sweeps", [])]
    return [p for p in paths if p]


def merge_reports(reports: list[dict]) -> dict:
    """Several runs' JSON (e.g. the workloads in one run, the sweeps in another) as one report."""
    merged = dict(reports[0])
    merged["workloads"] = [w for r in reports for w in r.get("workloads", [])]
    merged["sweeps"] = [s for r in reports for s in r.get("sweeps", [])]
    return merged


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m radixrt.bench.plots",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("reports", nargs="+", help="JSON files written by radixrt bench --json-out")
    ap.add_argument("--out", default="docs/img")
    args = ap.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append(json.load(f))
    for p in plot_report(merge_reports(reports), args.out):
        print(p, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
