"""Several stacks on one task: a table and a trade-off plot (compression against quality).

The baseline (plain transformers) is computed once for the whole sweep.  The plot uses
matplotlib's object API with the Agg canvas (imported only when a plot is written; no global
backend switch), one labelled point per stack and the uncompressed baseline as a star and a
dashed line.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from .report import format_table, markdown_table, mib
from .runner import HEADLINE, EvalResult, EvalSettings, Evaluator, environment


def run_sweep(evaluator: Evaluator, stacks: Sequence[Any], settings: EvalSettings) -> list[EvalResult]:
    """Run every stack on ``settings``' task; the baseline is computed once and reused."""
    return [evaluator.run(stack, settings) for stack in stacks]


def _metric_columns(task: str) -> list[tuple[str, str, str]]:
    """(header, metrics key, format) of the quality columns of a task."""
    if task == "ppl":
        return [("ppl", "ppl", "{:.4f}"), ("delta ppl", "delta_ppl", "{:+.2%}"), ("KL nats", "kl", "{:.5f}"),
                ("top-1", "top1", "{:.2%}")]
    if task == "passkey":
        return [("accuracy", "accuracy", "{:.0%}")]
    return [("agreement", "agreement", "{:.2%}"), ("prefix", "prefix", "{:.2%}")]


def sweep_rows(results: Sequence[EvalResult]) -> list[list[str]]:
    """Header plus one row per stack, the uncompressed baseline first."""
    first = results[0]
    cols = _metric_columns(first.settings.task)
    rows = [["stack", "compression", "cache MiB", *[c[0] for c in cols], "wall s"]]
    base = [fmt.format(first.baseline[key]) for _, key, fmt in cols]
    rows.append(["uncompressed (transformers)", f"{first.baseline_compression:.2f}x", mib(first.baseline_cache_bytes),
                 *base, f"{first.baseline_wall_s:.1f}"])
    for r in results:
        rows.append([r.stack_label, f"{r.compression:.2f}x", mib(r.cache_bytes),
                     *[fmt.format(r.metrics[key]) for _, key, fmt in cols], f"{r.wall_s:.1f}"])
    return rows


def sweep_table(results: Sequence[EvalResult], markdown: bool = False) -> str:
    rows = sweep_rows(results)
    text = results[0].settings_line() + "\n" + (markdown_table(rows) if markdown else format_table(rows))
    notes = sorted({n for r in results for n in r.notes})
    for note in notes:
        text += f"\nnote: {note}"
    return text


def sweep_dict(results: Sequence[EvalResult]) -> dict[str, Any]:
    """The sweep's JSON object: shared settings, the baseline once, and one result per stack."""
    first = results[0]
    s = first.settings
    return {"schema": "kvcompress.sweep/1", "task": s.task, "model": first.model, "dtype": first.dtype,
            "context": s.context, "samples": s.samples, "tokens": s.tokens, "seed": s.seed,
            "baseline": first.baseline, "baseline_cache_bytes": first.baseline_cache_bytes,
            "runs": [r.to_dict() for r in results], "environment": environment(first.env.get("device", "cpu"))}


def load_sweep(path: str | os.PathLike) -> list[EvalResult]:
    """The results of a sweep's JSON file (``--json`` of ``kvcompress eval --sweep``)."""
    import json

    with open(path, encoding="utf-8") as fh:
        obj = json.load(fh)
    return [EvalResult.from_dict(r) for r in obj["runs"]]


def plot_sweep(results: Sequence[EvalResult], path: str | os.PathLike, title: str | None = None) -> str:
    """Write the trade-off plot (PNG) to ``path``; returns the path."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - matplotlib is in the [eval] extra
        from ..errors import KVCompressError

        raise KVCompressError("plots need matplotlib: pip install 'kvcompress[eval]'") from exc
    first = results[0]
    task = first.settings.task
    key, higher_better = HEADLINE[task]
    labels = {"ppl": "perplexity (lower is better)", "accuracy": "passkey accuracy (higher is better)",
              "agreement": "token agreement with uncompressed (higher is better)"}
    fig = Figure(figsize=(7.5, 5.0), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs = [r.compression for r in results]
    ys = [r.metrics[key] for r in results]
    bx, by = first.baseline_compression, first.baseline[key]
    ax.scatter(xs, ys, s=40, color="tab:blue", zorder=3, label="stacks")
    for r, x, y in zip(results, xs, ys):
        ax.annotate(r.stack_label, (x, y), textcoords="offset points", xytext=(6, 5), fontsize=8)
    ax.scatter([bx], [by], marker="*", s=180, color="tab:red", zorder=4, label="uncompressed (transformers)")
    ax.axhline(by, color="tab:red", linestyle="--", linewidth=0.8, zorder=1)
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    allx = xs + [bx]
    if max(allx) / max(min(allx), 1e-9) > 8:
        ax.set_xscale("log")
        ticks = [2.0 ** k for k in range(-4, 13) if min(allx) / 1.5 <= 2.0 ** k <= max(allx) * 1.5]
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlabel("compression: dense fp16 bytes / bytes held by the cache (end of prefill)")
    ax.set_ylabel(labels[key])
    if task == "ppl" and max(ys + [by]) / max(min(ys + [by]), 1e-9) > 4:
        ax.set_yscale("log")
    s = first.settings
    ax.set_title(title or f"{task}: {first.model} ({first.dtype}), context {s.context}, "
                 f"{s.samples} x {s.tokens} tokens", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(os.fspath(path))
    return os.fspath(path)
