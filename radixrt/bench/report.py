"""The tables of ``radixrt bench``: per-workload rows (plain text or
Markdown), the headline ratios per workload, the sweeps, and the whole report.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from radixrt.bench.driver import HF_LABEL, OFF, REF

COLUMNS = [
    # key, header, format, width
    ("system", "system", "{}", 30),
    ("mode", "mode", "{}", 7),
    ("wall_s", "wall s", "{:.2f}", 8),
    ("time_ratio", "x radixrt", "{:.2f}", 9),
    ("request_throughput", "req/s", "{:.2f}", 7),
    ("output_throughput", "out tok/s", "{:.1f}", 9),
    ("p50_ttft_ms", "TTFT p50", "{:.0f}", 8),
    ("p99_ttft_ms", "TTFT p99", "{:.0f}", 8),
    ("p50_itl_ms", "ITL p50", "{:.0f}", 7),
    ("p99_itl_ms", "ITL p99", "{:.0f}", 7),
    ("cache_hit_rate", "hit", "{:.1%}", 6),
    ("prompt_tokens_computed", "computed", "{:.0f}", 8),
    ("computed_vs_ideal", "/ideal", "{:.2f}", 6),
    ("peak_kv_slots", "peak KV", "{:.0f}", 7),
    ("retractions", "retr", "{:.0f}", 4),
]


def _fmt(fmt: str, v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def add_ratios(rows: list[dict]) -> None:
    """time_ratio: wall time over the radixrt row of the same mode (>1: slower than radixrt)."""
    ref = {r["mode"]: r["wall_s"] for r in rows if r["system"] == REF}
    for r in rows:
        base = ref.get(r["mode"], ref.get("offline"))
        r["time_ratio"] = r["wall_s"] / base if base else None


def format_table(rows: list[dict], markdown: bool = False) -> str:
    if markdown:
        lines = [
            "| " + " | ".join(h for _, h, _, _ in COLUMNS) + " |",
            "|" + "|".join("---" if k in ("system", "mode") else "---:" for k, *_ in COLUMNS) + "|",
        ]
        lines += ["| " + " | ".join(_fmt(f, r.get(k)) for k, _, f, _ in COLUMNS) + " |" for r in rows]
        return "\n".join(lines)
    head = " ".join(f"{h:<{w}}" if i < 2 else f"{h:>{w}}" for i, (_, h, _, w) in enumerate(COLUMNS))
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            " ".join(
                f"{_fmt(f, r.get(k)):<{w}}" if i < 2 else f"{_fmt(f, r.get(k)):>{w}}"
                for i, (k, _, f, w) in enumerate(COLUMNS)
            )
        )
    return "\n".join(lines)


def headline(report: dict) -> list[dict]:
    """One line per workload: the ratios people decide on."""
    out = []
    for w in report["workloads"]:
        rows = {(r["mode"], r["system"].split(" (")[0]): r for r in w["rows"]}
        ref = rows.get(("offline", REF))
        if ref is None:
            continue

        def speed(key: tuple[str, str], base: Optional[dict] = ref, rows: dict = rows) -> Optional[float]:
            r = rows.get(key)
            return r["wall_s"] / base["wall_s"] if r and base else None

        on, off = rows.get(("online", REF)), rows.get(("online", OFF))
        out.append(
            {
                "workload": w["name"],
                "vs_transformers": speed(("offline", HF_LABEL)),
                "vs_cache_off": speed(("offline", OFF)),
                "fcfs_time": speed(("offline", f"{REF} fcfs")),
                "dfs_weight_time": speed(("offline", f"{REF} dfs-weight")),
                "hit_rate": ref["cache_hit_rate"],
                "computed_vs_ideal": ref.get("computed_vs_ideal"),
                "cache_off_computed_vs_ideal": (rows.get(("offline", OFF)) or {}).get("computed_vs_ideal"),
                "online_ttft_p50_off_over_on": (
                    off["p50_ttft_ms"] / on["p50_ttft_ms"] if on and off and on.get("p50_ttft_ms") else None
                ),
                "online_throughput_on_over_off": (
                    on["output_throughput"] / off["output_throughput"]
                    if on and off and off.get("output_throughput")
                    else None
                ),
            }
        )
    return out


HEADLINE_COLUMNS = [
    ("workload", "workload", "{}"),
    ("vs_transformers", "speedup vs transformers", "{:.2f}x"),
    ("vs_cache_off", "speedup vs cache off", "{:.2f}x"),
    ("hit_rate", "cache hit (tokens)", "{:.1%}"),
    ("computed_vs_ideal", "computed / ideal", "{:.2f}"),
    ("cache_off_computed_vs_ideal", "cache off: computed / ideal", "{:.2f}"),
    ("fcfs_time", "fcfs time / lpm", "{:.2f}"),
    ("dfs_weight_time", "dfs-weight time / lpm", "{:.2f}"),
    ("online_ttft_p50_off_over_on", "online TTFT p50 off/on", "{:.2f}x"),
    ("online_throughput_on_over_off", "online tok/s on/off", "{:.2f}x"),
]


def format_headline(lines: list[dict], markdown: bool = False) -> str:
    cols = [c for c in HEADLINE_COLUMNS if any(line.get(c[0]) is not None for line in lines)]
    cells = [[_fmt(f, line.get(k)) for k, _, f in cols] for line in lines]
    if markdown:
        out = [
            "| " + " | ".join(h for _, h, _ in cols) + " |",
            "|" + "|".join("---" if k == "workload" else "---:" for k, *_ in cols) + "|",
        ]
        return "\n".join(out + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(cols)]
    out = ["  ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, ((_, h, _), w) in enumerate(zip(cols, widths)))]
    out += [
        "  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(row, widths))) for row in cells
    ]
    return "\n".join(out)


SWEEP_COLUMNS = [
    ("x", "", "{}"),
    ("system", "system", "{}"),
    ("wall_s", "wall s", "{:.2f}"),
    ("time_ratio", "x radixrt", "{:.2f}"),
    ("output_throughput", "out tok/s", "{:.1f}"),
    ("prompt_tokens_computed", "computed", "{:.0f}"),
    ("ideal_prompt_tokens", "ideal", "{:.0f}"),
    ("peak_kv_slots", "peak KV", "{:.0f}"),
    ("p50_ttft_ms", "TTFT p50", "{:.0f}"),
    ("retractions", "retr", "{:.0f}"),
]


def format_sweep(sweep: dict, markdown: bool = False) -> str:
    xname = sweep["x"]
    heads = [xname if k == "x" else h for k, h, _ in SWEEP_COLUMNS]
    rows = [[_fmt(f, r.get(k)) for k, _, f in SWEEP_COLUMNS] for r in sweep["rows"]]
    if markdown:
        out = [
            "| " + " | ".join(heads) + " |",
            "|" + "|".join("---:" if i != 1 else "---" for i in range(len(heads))) + "|",
        ]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    out = ["  ".join(f"{h:>{w}}" if i != 1 else f"{h:<{w}}" for i, (h, w) in enumerate(zip(heads, widths)))]
    out += ["  ".join(f"{c:>{w}}" if i != 1 else f"{c:<{w}}" for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(out)


def render(report: dict, markdown: bool = False) -> str:
    parts = [
        f"radixrt bench: model {report['model']}, torch threads {report['torch_threads']}, "
        f"scale {report['args']['scale']}, KV pool {report['args']['max_total_tokens']} tokens"
    ]
    for w in report["workloads"]:
        title = f"{w['name']}: {w['shape']}"
        parts.append(f"\n### {title}\n" if markdown else f"\n== {title}")
        parts.append(format_table(w["rows"], markdown))
        valid = [
            (r["system"], r["mode"], r["valid_outputs"], r["completed"]) for r in w["rows"] if "valid_outputs" in r
        ]
        if valid:
            parts.append("valid outputs: " + ", ".join(f"{s} ({m}) {v}/{n}" for s, m, v, n in valid))
    if report["workloads"]:
        parts.append("\n### Headline ratios\n" if markdown else "\n== headline (offline unless marked online)")
        parts.append(format_headline(headline(report), markdown))
    for s in report["sweeps"]:
        parts.append(f"\n### Sweep: {s['x']}\n" if markdown else f"\n== sweep: {s['x']}")
        parts.append(format_sweep(s, markdown))
    return "\n".join(parts)
