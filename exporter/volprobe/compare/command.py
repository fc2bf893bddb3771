"""`volprobe compare`: baseline against candidate over days, from a Prometheus; a report and an exit status.

Exit status: 0 better or equivalent, 1 worse, 3 inconclusive, 2 an error (bad arguments, an unreachable or
failing server, specs that differ without --allow-different-specs).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from .. import ops, units
from ..state import write_atomically
from . import html, source, verdict
from .html import MissingExtra
from .report import Report

EXIT_ERROR = 2
HISTOGRAMS = {  # what each kind of histogram is, for the reports
    "native": "Prometheus' native histograms, buckets 0.54% wide at the exporter's schema 7",
    "classic": "the classic _bucket series, buckets as the exporter's `buckets` set them",
}
WARMING_PENALTY = 2.0  # first touches this many times slower than repeats: the volume is still warming up


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.3f} ms"


def _percent(value: str) -> float:
    text = value.strip()
    number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0 <= number < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: a tolerance between 0% and 100%")
    return number


def _duration(value: str) -> float:
    try:
        return units.parse_duration(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _quantiles(value: str) -> tuple[float, ...]:
    try:
        found = tuple(sorted({float(v) for v in value.split(",") if v.strip()}))
    except ValueError:
        found = ()
    if not found or not all(0 < q < 1 for q in found):
        raise argparse.ArgumentTypeError(f"{value!r}: quantiles between 0 and 1, comma-separated (0.5,0.99)")
    return found


def _time(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a Unix time or an ISO 8601 time") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def warnings_of(side: source.Side, name: str) -> list[str]:
    found = []
    for end, failures, histogram in zip(
        side.ends, side.failures or [0.0] * len(side.ends), side.histograms, strict=True
    ):
        if histogram.total <= 0:
            found.append(f"{name}: no probes in the period ending {_when(end)} (a gap in the data)")
        if failures > 0.5:
            found.append(f"{name}: {failures:.0f} failed probes in the period ending {_when(end)}")
    for end, seconds in zip(side.ends, side.throttled_seconds, strict=False):
        if seconds > 0.5:
            found.append(f"{name}: throttled for {seconds:.0f} s in the period ending {_when(end)}")
    warming = [(e, v) for e, v in zip(side.ends, side.first_touch_penalty, strict=False) if v > WARMING_PENALTY]
    if warming:
        worst = max(v for _, v in warming)
        found.append(
            f"{name}: probes on never-touched blocks were up to {worst:.1f}x slower than on blocks touched before, in "
            f"{len(warming)} of {len(side.ends)} periods (from {_when(warming[0][0])}): the volume is still warming up"
        )
    reads = sum(h.total for h in side.histograms)
    zero = sum(side.zero_reads)
    if reads and zero / reads > 0.01:
        found.append(
            f"{name}: {zero / reads:.0%} of reads returned zeros: the volume is not warm, latencies flatter it"
        )
    return found


def build(args: argparse.Namespace, api: source.PrometheusAPI) -> Report:
    end = args.end if args.end is not None else time.time()
    start = args.start if args.start is not None else end - args.since
    if end - start < args.period:
        raise source.SourceError(f"the span ({end - start:g} s) is shorter than one --period ({args.period:g} s)")
    baseline = source.fetch(api, args.baseline, args.op, start, end, args.period, args.histograms)
    candidate = source.fetch(api, args.candidate, args.op, start, end, args.period, args.histograms)
    for side, name in ((baseline, "baseline"), (candidate, "candidate")):
        if not side.specs:
            raise source.SourceError(f"{name} {{{side.selector}}}: no {args.op} probe found in the span")
        if len(side.specs) > 1:
            raise source.SourceError(f"{name} {{{side.selector}}}: several probe specs: {sorted(map(str, side.specs))}")
    different = baseline.specs != candidate.specs
    if different and not args.allow_different_specs:
        raise source.SourceError(
            f"the sides probe different things: baseline {next(iter(baseline.specs))}, candidate "
            f"{next(iter(candidate.specs))} (--allow-different-specs to compare anyway)"
        )
    kind = source.choose(baseline, candidate, args.histograms)
    if baseline.histograms[0].bounds != candidate.histograms[0].bounds:
        raise source.SourceError("the sides have different histogram buckets: their quantiles are not comparable")
    results = verdict.compare(
        baseline.histograms, candidate.histograms, tolerance=args.tolerance, quantiles=args.quantiles
    )
    warnings = warnings_of(baseline, "baseline") + warnings_of(candidate, "candidate")
    if different:
        warnings.insert(
            0, "the sides probe different specs (--allow-different-specs): the comparison is not like for like"
        )
    return Report(baseline, candidate, args.op, args.period, args.tolerance, results, warnings, different, kind)


def as_json(report: Report) -> str:
    def quantile(q: verdict.Quantile) -> dict[str, object]:
        return {"estimate_seconds": _finite(q.estimate), "bucket": [_finite(q.lower), _finite(q.upper)]}

    return json.dumps(
        {
            "verdict": report.verdict,
            "histograms": report.histograms,
            "op": report.op,
            "period_seconds": report.period,
            "tolerance": report.tolerance,
            "periods": len(report.baseline.ends),
            "baseline": {"selector": report.baseline.selector, "spec": sorted(map(str, report.baseline.specs))},
            "candidate": {"selector": report.candidate.selector, "spec": sorted(map(str, report.candidate.specs))},
            "quantiles": [
                {
                    "quantile": r.q,
                    "baseline": quantile(r.baseline),
                    "candidate": quantile(r.candidate),
                    "ratio": _finite(r.ratio),
                    "interval": [_finite(r.low), _finite(r.high)],
                    "verdict": r.verdict,
                    "reason": r.reason,
                }
                for r in report.results
            ],
            "probes": {
                "baseline": sum(h.total for h in report.baseline.histograms),
                "candidate": sum(h.total for h in report.candidate.histograms),
            },
            # Each period on its own: what the Migration dashboard's daily panels show, from the same buckets.
            "per_period": [
                {
                    "end": end,
                    "probes": {"baseline": base.total, "candidate": cand.total},
                    **{
                        f"p{r.q * 100:g}": {
                            "baseline": quantile(verdict.quantile(base, r.q)),
                            "candidate": quantile(verdict.quantile(cand, r.q)),
                        }
                        for r in report.results
                    },
                }
                for end, base, cand in zip(
                    report.baseline.ends, report.baseline.histograms, report.candidate.histograms, strict=True
                )
            ],
            "warnings": report.warnings,
        },
        indent=2,
    )


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def table(report: Report) -> list[tuple[str, ...]]:
    """The quantile table, header first, as text cells (markdown and HTML)."""
    rows: list[tuple[str, ...]] = [("quantile", "baseline", "candidate", "ratio", "95% interval", "verdict", "why")]
    for r in report.results:
        rows.append(
            (
                f"p{r.q * 100:g}",
                f"{_ms(r.baseline.estimate)} (bucket {_ms(r.baseline.lower)}..{_ms(r.baseline.upper)})",
                f"{_ms(r.candidate.estimate)} (bucket {_ms(r.candidate.lower)}..{_ms(r.candidate.upper)})",
                f"{r.ratio:.3f}",
                f"{r.low:.3f}..{r.high:.3f}",
                r.verdict,
                r.reason,
            )
        )
    return rows


def as_markdown(report: Report) -> str:
    base, cand = report.baseline, report.candidate
    head, *rows = table(report)
    lines = [
        f"# volprobe compare: **{report.verdict}**",
        "",
        f"- baseline `{{{base.selector}}}`: {', '.join(sorted(map(str, base.specs)))}",
        f"- candidate `{{{cand.selector}}}`: {', '.join(sorted(map(str, cand.specs)))}",
        f"- {len(base.ends)} periods of {report.period:g} s, ending {_when(base.ends[-1])}; tolerance "
        f"±{report.tolerance:.0%}; probes: {sum(h.total for h in base.histograms):,.0f} baseline, "
        f"{sum(h.total for h in cand.histograms):,.0f} candidate",
        f"- histograms: {report.histograms} ({HISTOGRAMS[report.histograms]})",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows),
        "",
        "Quantiles come from the histogram's bucket increases: each lies in the bucket shown, and is placed inside "
        "it geometrically. The interval resamples the periods (both sides together).",
    ]
    if report.warnings:
        lines += ["", "## Warnings", "", *(f"- {w}" for w in report.warnings)]
    return "\n".join(lines) + "\n"


def as_html(report: Report) -> str:
    return html.render(report, table(report), HISTOGRAMS[report.histograms])


def as_text(report: Report) -> str:
    """A terminal table (rich): the verdict, each quantile of both sides with its bucket, the ratio."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    colour = {"better": "green", "equivalent": "green", "worse": "red", "inconclusive": "yellow"}
    table = Table(title=f"volprobe compare: {report.verdict}", title_style=colour[report.verdict])
    for heading in ("quantile", "baseline", "candidate", "ratio", "95% interval", "verdict", "why"):
        table.add_column(heading)
    for r in report.results:
        table.add_row(
            f"p{r.q * 100:g}",
            f"{_ms(r.baseline.estimate)}\n({_ms(r.baseline.lower)}..{_ms(r.baseline.upper)})",
            f"{_ms(r.candidate.estimate)}\n({_ms(r.candidate.lower)}..{_ms(r.candidate.upper)})",
            f"{r.ratio:.3f}",
            f"{r.low:.3f}..{r.high:.3f}",
            f"[{colour[r.verdict]}]{r.verdict}[/]",
            escape(r.reason),
        )
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=sys.stdout.isatty())
    for name, side in (("baseline ", report.baseline), ("candidate", report.candidate)):
        console.print(escape(f"{name} {{{side.selector}}}: {', '.join(sorted(map(str, side.specs)))}"))
    console.print(escape(f"histograms: {report.histograms} ({HISTOGRAMS[report.histograms]})"))
    console.print(table)
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    return out.getvalue()


FORMATS = {"json": as_json, "markdown": as_markdown, "text": as_text, "html": as_html}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="volprobe compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--prometheus", required=True, help="URL of a server with the Prometheus query API")
    p.add_argument("--baseline", required=True, help="label matchers, e.g. 'target=\"db-aws\"'")
    p.add_argument("--candidate", required=True, help="label matchers, e.g. 'target=\"db-azure\"'")
    span = p.add_mutually_exclusive_group()
    span.add_argument("--since", type=_duration, default=7 * 86400.0, help="the span ending now (default 7d)")
    span.add_argument("--start", type=_time, help="start of the span (Unix or ISO 8601 time); with --end")
    p.add_argument("--end", type=_time, help="end of the span (default now)")
    p.add_argument("--period", type=_duration, default=86400.0, help="length of one period (default 1d)")
    p.add_argument("--op", choices=ops.NAMES, default=ops.WRITE.name)
    p.add_argument("--tolerance", type=_percent, default=0.10, help="equivalent within this (default 10%%)")
    p.add_argument("--allow-different-specs", action="store_true")
    p.add_argument("--format", choices=sorted(FORMATS), default="text")
    p.add_argument(
        "--histograms",
        choices=source.KINDS,
        default="auto",
        help="native (Prometheus' native histograms), classic (the _bucket series) or auto (default): native "
        "where both sides have them over the span",
    )
    p.add_argument("--quantiles", type=_quantiles, default=verdict.QUANTILES, help="default 0.5,0.9,0.99,0.999")
    p.add_argument("--output", help="write the report to this new file (default: standard output)")
    p.add_argument("--force", action="store_true", help="with --output: replace a file that exists")
    p.add_argument("--bearer-token-file")
    p.add_argument("--username", help="basic auth user (password from --password-file)")
    p.add_argument("--password-file")
    p.add_argument("--ca-file")
    p.add_argument("--cert-file")
    p.add_argument("--key-file")
    p.add_argument("--insecure-skip-verify", action="store_true")
    return p


def run(argv: Sequence[str]) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exit_:
        return EXIT_ERROR if exit_.code else 0
    auth = source.Auth(
        args.bearer_token_file,
        args.username,
        args.password_file,
        args.ca_file,
        args.cert_file,
        args.key_file,
        args.insecure_skip_verify,
    )
    if args.output and os.path.exists(args.output) and not args.force:
        print(f"volprobe compare: --output {args.output} exists (--force to replace it)", file=sys.stderr)
        return EXIT_ERROR
    try:
        report = build(args, source.PrometheusAPI(args.prometheus, auth))
        text = FORMATS[args.format](report)
    except (source.SourceError, MissingExtra, OSError) as err:
        print(f"volprobe compare: {err}", file=sys.stderr)
        return EXIT_ERROR
    if args.output:
        write_atomically(args.output, text, mode=0o644)  # whole or not at all
    else:
        sys.stdout.write(text)
    return verdict.EXIT_STATUS[report.verdict]
