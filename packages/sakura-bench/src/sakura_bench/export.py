"""``sakura-bench export reports/*.json``: a Markdown summary, PNG charts and one
self-contained HTML page (the charts embedded as base64, no external resource).

Runs are grouped by workload and framework; in each group every ``sakura`` run is compared
with the ``baseline`` run (speed-up with its range and verdict, as ``compare`` does).
Charts are drawn with matplotlib's Agg canvas (no display needed).
"""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sakura_bench.compare import compare_reports, label
from sakura_bench.errors import BenchError
from sakura_bench.report import load_report

__all__ = ["export_reports"]

CHARTS = (
    ("wall_time.png", "wall_s", "Wall time per trial (s)", 1.0),
    ("step_time.png", "step_time_s", "Step time, median after warm-up (ms)", 1000.0),
    ("throughput.png", "samples_per_s", "Samples per second (end to end)", 1.0),
)


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def _stat(s: Mapping[str, Any] | None, scale: float = 1.0) -> str:
    if not s:
        return "–"
    return f"{_fmt(s['median'] * scale)} ({_fmt(s['min'] * scale)}–{_fmt(s['max'] * scale)})"


def _bar_chart(
    reports: Sequence[Mapping[str, Any]], key: str, title: str, scale: float, path: Path
) -> bool:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [(label(r), r["summary"].get(key)) for r in reports if r["summary"].get(key)]
    if not rows:
        return False
    names = [n for n, _ in rows]
    medians = [s["median"] * scale for _, s in rows]
    low = [(s["median"] - s["min"]) * scale for _, s in rows]
    high = [(s["max"] - s["median"]) * scale for _, s in rows]
    fig = Figure(figsize=(9, 1.2 + 0.55 * len(rows)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    positions = list(range(len(rows)))[::-1]
    colors = [
        "#9aa5b1" if r["runner"] == "baseline" else "#e07a9b"
        for r in reports
        if r["summary"].get(key)
    ]
    ax.barh(positions, medians, xerr=[low, high], color=colors, capsize=4)
    ax.set_yticks(positions, names, fontsize=8)
    ax.set_title(title + " — median, bars: min–max over trials", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return True


def _epoch_chart(reports: Sequence[Mapping[str, Any]], path: Path) -> bool:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in reports if r["summary"].get("train_epoch_s")]
    if not rows:
        return False
    fig = Figure(figsize=(9, 1.2 + 0.55 * len(rows)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    positions = list(range(len(rows)))[::-1]
    train = [r["summary"]["train_epoch_s"]["median"] for r in rows]
    evals = [(r["summary"].get("eval_epoch_s") or {}).get("median", 0.0) for r in rows]
    ax.barh(positions, train, color="#4c78a8", label="training")
    ax.barh(
        positions, evals, left=train, color="#f58518", label="evaluation on the training thread"
    )
    ax.set_yticks(positions, [label(r) for r in rows], fontsize=8)
    ax.set_title("Per epoch (s, medians)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return True


def _groups(reports: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], list[Mapping[str, Any]]]:
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in reports:
        groups.setdefault((r["workload"]["name"], r["framework"]), []).append(r)
    for runs in groups.values():
        runs.sort(key=lambda r: (r["runner"] != "baseline", " ".join(r.get("services", []))))
    return groups


def _comparisons(reports: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for runs in _groups(reports).values():
        base = next((r for r in runs if r["runner"] == "baseline"), None)
        if base is None:
            continue
        out += [compare_reports(base, r) for r in runs if r is not base]
    return out


def _table(reports: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["run", "trials", "wall s", "step ms", "samples/s", "final metrics", "peak RSS MiB"]
    rows = []
    for r in reports:
        s = r["summary"]
        metrics = ", ".join(f"{k} {_fmt(v, 4)}" for k, v in (s.get("final_metrics") or {}).items())
        rows.append(
            [
                label(r),
                str(len(r["trials"])),
                _stat(s.get("wall_s")),
                _stat(s.get("step_time_s"), 1000.0),
                _stat(s.get("samples_per_s")),
                metrics or "–",
                _fmt(s.get("peak_rss_mib"), 5),
            ]
        )
    return headers, rows


def _environment_lines(reports: Sequence[Mapping[str, Any]]) -> list[str]:
    seen: list[str] = []
    for r in reports:
        env = r["environment"]
        versions = env.get("versions", {})
        git = env.get("git") or {}
        line = (
            f"{env.get('cpu')} ({env.get('cpu_affinity') or env.get('cpu_logical_cores')} cores usable), "
            f"device {env.get('device')}, torch {versions.get('torch')}, "
            f"{env.get('torch_threads')} torch threads, python {versions.get('python')}, "
            f"git {str(git.get('revision', '?'))[:10]}{' (modified)' if git.get('dirty') else ''}"
        )
        if line not in seen:
            seen.append(line)
    return seen


def _comparison_lines(comparisons: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = []
    for c in comparisons:
        low, high = c["speedup_range"]
        text = (
            f"{c['b']['label']} vs {c['a']['label']}: {c['speedup']:.2f}× "
            f"(range {low:.2f}–{high:.2f}), {c['verdict']}"
        )
        if c.get("ideal_overlap_speedup"):
            text += f"; ideal overlap bound {c['ideal_overlap_speedup']:.2f}×"
        if c.get("metrics_agree") is False:
            text += "; final metrics differ"
        lines.append(text + ".")
        lines += [f"  note: {n}" for n in c["notes"] + c["advice"]]
    return lines


def export_reports(
    paths: Sequence[str | os.PathLike[str]], output: str | os.PathLike[str]
) -> dict[str, Path]:
    """Write ``summary.md``, the charts and ``report.html`` into ``output``; return the
    written files by name."""
    if not paths:
        raise BenchError(
            "export needs at least one report file (e.g. sakura-bench export reports/*.json)"
        )
    reports = [load_report(p) for p in paths]
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    ordered = [r for runs in _groups(reports).values() for r in runs]
    written: dict[str, Path] = {}
    for name, key, title, scale in CHARTS:
        if _bar_chart(ordered, key, title, scale, out / name):
            written[name] = out / name
    if _epoch_chart(ordered, out / "epochs.png"):
        written["epochs.png"] = out / "epochs.png"
    headers, rows = _table(ordered)
    comparisons = _comparisons(ordered)
    env_lines = _environment_lines(ordered)
    charts = [
        n
        for n in ("wall_time.png", "step_time.png", "throughput.png", "epochs.png")
        if n in written
    ]

    md = ["# sakura-bench results", ""]
    md += ["Environment:", ""] + [f"- {line}" for line in env_lines] + [""]
    md += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    md += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    md += ["", "Times: median (min–max) over trials; each trial ran in a fresh process.", ""]
    if comparisons:
        md += ["## Comparisons against the baseline", ""]
        md += [
            f"- {line}" if not line.startswith("  ") else f"  - {line.strip()}"
            for line in _comparison_lines(comparisons)
        ]
        md.append("")
    if charts:
        md += ["## Charts", ""] + [f"![{n}]({n})" for n in charts] + [""]
    written["summary.md"] = out / "summary.md"
    written["summary.md"].write_text("\n".join(md), encoding="utf-8")

    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>sakura-bench results</title>',
        "<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;font-size:14px}"
        "th{background:#f4f4f4}img{max-width:100%;display:block;margin:1em 0}</style></head><body>",
        "<h1>sakura-bench results</h1>",
        "<h2>Environment</h2><ul>"
        + "".join(f"<li>{esc(line)}</li>" for line in env_lines)
        + "</ul>",
        "<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in headers) + "</tr>",
        *("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows),
        "</table><p>Times: median (min–max) over trials; each trial ran in a fresh process.</p>",
    ]
    if comparisons:
        parts.append("<h2>Comparisons against the baseline</h2><ul>")
        parts += [f"<li>{esc(line.strip())}</li>" for line in _comparison_lines(comparisons)]
        parts.append("</ul>")
    for name in charts:
        data = base64.b64encode(written[name].read_bytes()).decode("ascii")
        parts.append(f'<img alt="{esc(name)}" src="data:image/png;base64,{data}">')
    parts.append("</body></html>")
    written["report.html"] = out / "report.html"
    written["report.html"].write_text("\n".join(parts), encoding="utf-8")
    return written
