"""``benchmarks/kernel_grid_matrix.py``: issue 19's grid from benchutil JSON files, each cell's latest measurement.

The script is run as users run it (a subprocess) on small JSON files written here, and its matrix and counts are
checked against the rows those files hold; and the committed source list reproduces the count the docs quote.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/kernel_grid_matrix.py"


def _row(op, batch, ctx, speedup, us=10.0, model="llama3-8b"):
    return {"op": op, "model": model, "batch": batch, "ctx": ctx, "latency_us": us, "speedup_vs_sdpa": speedup,
            "pct_of_peak": 50.0}


def _run(*args) -> str:
    res = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_later_files_replace_cells_and_the_count_follows(tmp_path):
    old = tmp_path / "old.json"
    new = tmp_path / "new.json"
    sweep = tmp_path / "sweep.json"
    old.write_text(json.dumps({"rows": [_row("sdpa", 1, 4096, 1.0), _row("none", 1, 4096, 0.8),
                                        _row("kivi2", 1, 4096, 2.0), _row("lowrank", 1, 4096, 0.5),
                                        {"op": "lowrank", "model": "llama3-8b", "batch": 4, "ctx": 4096,
                                         "latency_us": None, "error": "oom"}]}))
    new.write_text(json.dumps({"rows": [_row("none", 1, 4096, 1.2, us=7.0)]}))
    # a sweep file: two runs; the second's rows count, the first's do not
    sweep.write_text(json.dumps({"config_1": {"rows": [_row("kivi2", 1, 4096, 0.1)]},
                                 "config_2": {"rows": [_row("lowrank", 1, 4096, 0.9)]}}))
    listing = tmp_path / "sources.txt"
    listing.write_text("# oldest first\nold.json\n\nnew.json   # replaces none\nsweep.json:config_2\n")
    out = _run("--sources", listing, "--count", "--only-grid")
    # none: the later 1.2 (not bold), kivi2 2.0 (config_1 is not read), lowrank the sweep's 0.9 (bold)
    assert re.search(r"\| none \| 1\.20 \|", out)
    assert re.search(r"\| kivi2 \| 2\.00 \|", out)
    assert re.search(r"\| lowrank \| \*\*0\.90\*\* \|", out)
    assert "sdpa" not in out.split("| model |")[0]
    assert "**1 of 3 cells below 1.0x.**" in out
    assert "0 of the 1 at 0.98x or above" in out  # lowrank's 0.90 is not near 1.0x
    assert re.search(r"\| llama3-8b \| none \| 1 \| 0 \| new\.json \(1\) \|", out)
    assert "sweep.json:config_2 (1)" in out
    # the same files in the opposite order: the older rows win
    out = _run(new, old, "--count")
    assert "**2 of 3 cells below 1.0x.**" in out
    assert "0 of the 2 at 0.98x or above" in out
    near = tmp_path / "near.json"  # 0.985 is near, 0.975 and 1.0 are not (1.0 is not below)
    near.write_text(json.dumps({"rows": [_row("none", 1, 4096, 0.985), _row("kivi2", 1, 4096, 0.975),
                                         _row("lowrank", 1, 4096, 1.0)]}))
    out = _run(near, "--count")
    assert "**2 of 3 cells below 1.0x.**" in out and "1 of the 2 at 0.98x or above" in out
    assert _run(old, new, "--metric", "us").count("7.0") == 1


def test_a_printed_table_stands_in_for_a_lost_json(tmp_path):
    """A benchutil table (``.md``) is read as rows: op without its implementation, context in tokens, the printed
    latency and speed-up; other lines (headers, timestamps, log text) are skipped; it replaces older cells as a JSON
    does."""
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"rows": [_row("none", 1, 4096, 0.8), _row("lowrank", 4, 32768, 1.5)]}))
    table = tmp_path / "grid_log.md"
    table.write_text("Sat Dec  5 11:36:29 AM UTC 2026\n"
                     "| op | model | B | ctx | latency (µs) | bytes read (MB) | TB/s | % of 4.3 TB/s | vs SDPA "
                     "| vs ref |\n"
                     "|---|---|---|---|---|---|---|---|---|---|\n"
                     "| sdpa | llama3-8b | 1 | 4k | 18.7 | 16.8 | 0.90 | 21% | 1.00x | n/a |\n"
                     "| none (lanes:triton) | llama3-8b | 1 | 4k | 13.0 | 16.8 | 1.30 | 30% | 1.44x | n/a |\n"
                     "| lowrank (lanes:triton) | llama3-8b | 4 | 32k | 120.0 | 1.0 | 1.00 | 23% | 0.96x | n/a |\n"
                     "[benchutil 39.2 s] none llama3-8b B1 4k: 13.0 us\n")
    listing = tmp_path / "sources.txt"
    listing.write_text("old.json\ngrid_log.md\n")
    out = _run("--sources", listing, "--count", "--only-grid")
    assert re.search(r"\| none \| 1\.44 \| - \|", out)  # (B1/4k, B4/32k)
    assert re.search(r"\| lowrank \| - \| \*\*0\.96\*\* \|", out)
    assert "**1 of 2 cells below 1.0x.**" in out
    assert re.search(r"\| llama3-8b \| lowrank \| 1 \| 1 \| grid_log\.md \(1\) \|", out)
    assert _run(table, "--metric", "us").count("120.0") == 1


def test_a_missing_key_is_a_clear_error(tmp_path):
    f = tmp_path / "sweep.json"
    f.write_text(json.dumps({"config_1": {"rows": []}}))
    res = subprocess.run([sys.executable, str(SCRIPT), f"{f}:config_9"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode != 0
    assert "config_9" in res.stderr and "config_1" in res.stderr


def test_the_committed_sources_give_the_documented_count():
    """docs/data/grid_latest.txt is what the README's count of cells below SDPA is computed from."""
    out = _run("--sources", ROOT / "docs/data/grid_latest.txt", "--count", "--only-grid")
    n = int(re.search(r"\*\*(\d+) of (\d+) cells below 1\.0x\.\*\*", out).group(1))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quoted = re.search(r"\((\d+) of 312 cells below 1x", readme)
    assert quoted is not None, "README quotes the grid's count"
    assert n == int(quoted.group(1))


def test_the_readme_table_is_the_committed_grids_summary():
    """The README's per-op table of issue 19's grid is ``--summary`` of docs/data/grid_latest.txt, line for line, and its
    cells below 1x add up to the count the README quotes."""
    out = _run("--sources", ROOT / "docs/data/grid_latest.txt", "--summary", "--only-grid").strip().splitlines()
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = readme.index(out[0])
    assert readme[start:start + len(out)] == out
    below = sum(int(re.search(r"\| (\d+) of \d+ \|$", line).group(1)) for line in out[2:])
    quoted = re.search(r"\((\d+) of 312 cells below 1x", "\n".join(readme))
    assert quoted is not None and below == int(quoted.group(1))


def test_summary_gives_each_ops_range_per_model_from_the_latest_cells(tmp_path):
    old = tmp_path / "old.json"
    new = tmp_path / "new.json"
    old.write_text(json.dumps({"rows": [_row("none", 1, 4096, 0.8), _row("none", 4, 4096, 1.3),
                                        _row("none", 1, 4096, 1.7, model="smollm2-135m"),
                                        _row("kivi2", 1, 4096, 2.5), _row("sdpa", 1, 4096, 1.0)]}))
    new.write_text(json.dumps({"rows": [_row("none", 4, 4096, 0.9)]}))  # replaces the 1.3
    out = _run(old, new, "--summary", "--only-grid").strip().splitlines()
    assert out[0] == "| op | Llama-3-8B heads | SmolLM2 heads | below 1x |"
    assert "| kivi2 | 2.50-2.50x | - | 0 of 1 |" in out
    assert "| none | 0.80-0.90x | 1.70-1.70x | 2 of 3 |" in out
    assert not any(line.startswith("| sdpa") for line in out)
