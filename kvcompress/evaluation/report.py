"""Reporting helpers shared by the evaluation commands: environment facts, a progress bar, tables."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import sys
import time
from typing import Any, Sequence, TextIO


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The CPU model name (from /proc/cpuinfo on Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: Any = "cpu") -> dict[str, Any]:
    """Machine, library versions and date of a measurement (does not import transformers)."""
    import torch

    device = str(device)
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "system": platform.platform(terse=True),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "gpu": None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "kvcompress": _version("kvcompress"),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


class Progress:
    """A dependency-free progress bar on stderr.

    On a terminal it redraws one line (at most 10 times a second); otherwise it prints a line
    at each quarter, so logs of long runs show progress without flooding.  ``enabled=False``
    silences it.
    """

    def __init__(self, total: int, desc: str, *, stream: TextIO | None = None, enabled: bool = True,
                 width: int = 28):
        self.total, self.desc, self.width = max(1, int(total)), desc, width
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.n = 0
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._last_quarter = 0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, n: int = 1) -> None:
        self.n = min(self.total, self.n + n)
        if not self.enabled:
            return
        if self._tty:
            now = time.perf_counter()
            if now - self._last_draw >= 0.1 or self.n == self.total:
                self._last_draw = now
                self.stream.write("\r" + self.line())
                self.stream.flush()
        else:
            quarter = 4 * self.n // self.total
            if quarter > self._last_quarter:
                self._last_quarter = quarter
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def line(self) -> str:
        frac = self.n / self.total
        filled = int(round(frac * self.width))
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        bar = "#" * filled + "-" * (self.width - filled)
        return f"{self.desc} [{bar}] {self.n}/{self.total} {elapsed:.0f}s elapsed, ~{eta:.0f}s left"

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def format_table(rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """Monospace table; the first row is the header.  ``align``: one of ``l``/``r`` per column."""
    cells = [[str(c) for c in row] for row in rows]
    ncol = max(len(r) for r in cells)
    cells = [r + [""] * (ncol - len(r)) for r in cells]
    align = align or "l" + "r" * (ncol - 1)
    widths = [max(len(r[i]) for r in cells) for i in range(ncol)]

    def fmt(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)).rstrip()

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines)


def markdown_table(rows: Sequence[Sequence[Any]]) -> str:
    """The same rows as a Markdown table (for docs/results.md)."""
    cells = [[str(c) for c in row] for row in rows]
    out = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])]
    out += ["| " + " | ".join(r) + " |" for r in cells[1:]]
    return "\n".join(out)


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"
