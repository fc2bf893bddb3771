"""The HTML report of `volprobe compare`: one self-contained file (inline SVG plots, no scripts, no links out)
to attach to a change ticket. The plots are matplotlib's, an optional extra: pip install 'volprobe[report]'.

Three plots: each period's quantiles of both sides over time; both sides' latency distributions (CDF) over
the whole span, drawn as the histogram gives them (steps at the bucket bounds: nothing between bounds is
invented); the ratio of each quantile with its interval and the tolerance band.
"""

from __future__ import annotations

import html
import io
import math
from datetime import UTC, datetime
from types import ModuleType
from typing import TYPE_CHECKING

from . import verdict
from .report import Report

if TYPE_CHECKING:
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure

PLOT_QUANTILES = (0.5, 0.99)
COLOURS = {"baseline": "#1f77b4", "candidate": "#d62728"}


class MissingExtra(Exception):
    """matplotlib is not installed."""


def _pyplot() -> ModuleType:
    try:
        import matplotlib
    except ImportError:
        raise MissingExtra("--format html needs matplotlib: pip install 'volprobe[report]'") from None
    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def _svg(figure: Figure) -> str:
    out = io.StringIO()
    figure.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = out.getvalue()
    return text[text.index("<svg") :]  # inline: without the XML prologue


def _over_time(plt: ModuleType, report: Report) -> str:
    figure, axes = plt.subplots(figsize=(9, 3.6))
    for name, side in (("baseline", report.baseline), ("candidate", report.candidate)):
        when = [datetime.fromtimestamp(e, UTC) for e in side.ends]
        for q, style in zip(PLOT_QUANTILES, ("-", "--"), strict=True):
            values = [verdict.quantile(h, q).estimate * 1e3 for h in side.histograms]
            axes.plot(when, values, style, marker="o", color=COLOURS[name], label=f"{name} p{q * 100:g}")
    axes.set_yscale("log")
    _plain_numbers(axes.yaxis)
    axes.set_ylabel("latency per period (ms)")
    axes.set_title("Quantiles of each period")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    figure.autofmt_xdate()
    return _finish(plt, figure)


def _cdf(plt: ModuleType, report: Report) -> str:
    figure, axes = plt.subplots(figsize=(9, 3.6))
    shown: list[float] = []
    for name, side in (("baseline", report.baseline), ("candidate", report.candidate)):
        whole = verdict.total(side.histograms)
        total = whole.total
        if total <= 0:
            continue
        xs, ys, seen = [], [], 0.0
        for bound, count in zip(whole.bounds, whole.counts, strict=True):
            seen += count
            if math.isfinite(bound):
                xs.append(bound * 1e3)
                ys.append(seen / total)
        axes.step(xs, ys, where="post", color=COLOURS[name], label=f"{name} ({total:,.0f} probes)")
        below = [x for x, y in zip(xs, ys, strict=True) if y == 0]
        above = [x for x, y in zip(xs, ys, strict=True) if y >= 1]
        shown += [below[-1] if below else xs[0], above[0] if above else xs[-1]]
    axes.set_xscale("log")
    _plain_numbers(axes.xaxis, minor=False)
    from matplotlib.ticker import LogLocator

    axes.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    if shown:  # from the last empty bucket below to the first full one above: not out to 20 s
        axes.set_xlim(min(shown), max(shown))
    axes.set_xlabel("latency (ms), at the histogram's bucket bounds")
    axes.set_ylabel("fraction of probes at or below")
    axes.set_title("Latency distribution over the whole span")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small", loc="lower right")
    return _finish(plt, figure)


def _ratios(plt: ModuleType, report: Report) -> str:
    figure, axes = plt.subplots(figsize=(9, 3.2))
    results = [r for r in report.results if math.isfinite(r.ratio)]
    labels = [f"p{r.q * 100:g}" for r in results]
    for i, r in enumerate(results):
        low = r.ratio - r.low if math.isfinite(r.low) else 0.0
        high = r.high - r.ratio if math.isfinite(r.high) else 0.0
        colour = {"worse": "#d62728", "better": "#2ca02c", "equivalent": "#2ca02c"}.get(r.verdict, "#ff7f0e")
        axes.errorbar([i], [r.ratio], yerr=[[low], [high]], fmt="o", capsize=6, color=colour)
    axes.axhspan(1 - report.tolerance, 1 + report.tolerance, color="#999999", alpha=0.2, label="tolerance")
    axes.axhline(1.0, color="#555555", linewidth=0.8)
    axes.set_xticks(range(len(labels)), labels)
    axes.set_xlim(-0.5, max(0.5, len(labels) - 0.5))
    axes.set_ylabel("candidate / baseline")
    axes.set_title("Ratio of each quantile, with its 95% interval over periods")
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(fontsize="small")
    return _finish(plt, figure)


def _plain_numbers(axis: Axis, minor: bool = True) -> None:
    """1.5 rather than 1.5x10^0 on a log axis."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(ScalarFormatter() if minor else NullFormatter())


def _finish(plt: ModuleType, figure: Figure) -> str:
    try:
        return _svg(figure)
    finally:
        plt.close(figure)


def render(report: Report, markdown_table: list[tuple[str, ...]], histograms: str) -> str:
    """The whole page. `markdown_table`: the rows of the quantile table (header first), as text cells;
    `histograms`: what the histograms the quantiles come from are."""
    plt = _pyplot()
    e = html.escape
    base, cand = report.baseline, report.candidate
    head, *rows = markdown_table
    table = "<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in head) + "</tr>"
    for row in rows:
        table += "<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>"
    table += "</table>"
    warnings = "".join(f"<li>{e(w)}</li>" for w in report.warnings)
    colour = {"worse": "#d62728", "inconclusive": "#ff7f0e"}.get(report.verdict, "#2ca02c")
    span = (
        f"{len(base.ends)} periods of {report.period:g} s, ending "
        f"{datetime.fromtimestamp(base.ends[-1], UTC):%Y-%m-%d %H:%M UTC}; tolerance ±{report.tolerance:.0%}"
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>volprobe compare: {e(report.verdict)}</title>
<style>
body {{ font-family: sans-serif; max-width: 960px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }} td, th {{ border: 1px solid #ccc; padding: 4px 8px; }}
th {{ background: #f4f4f4; }} .verdict {{ color: {colour}; }} code {{ background: #f4f4f4; padding: 0 3px; }}
</style></head><body>
<h1>volprobe compare: <span class="verdict">{e(report.verdict)}</span></h1>
<ul>
<li>baseline <code>{{{e(base.selector)}}}</code>: {e(", ".join(sorted(map(str, base.specs))))}</li>
<li>candidate <code>{{{e(cand.selector)}}}</code>: {e(", ".join(sorted(map(str, cand.specs))))}</li>
<li>{e(span)}</li>
<li>histograms: {e(report.histograms)} ({e(histograms)})</li>
</ul>
{table}
<p>Quantiles come from the histogram's bucket increases: each lies in the bucket shown, and is placed inside it
geometrically. The interval resamples the periods (both sides together).</p>
{"<h2>Warnings</h2><ul>" + warnings + "</ul>" if warnings else ""}
<h2>Over time</h2>
{_over_time(plt, report)}
<h2>Distributions</h2>
{_cdf(plt, report)}
<h2>Ratios</h2>
{_ratios(plt, report)}
</body></html>
"""
