"""benchmarks/sweep_table.py on a made-up sweep whose numbers are worked out by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _row(op, batch, us):
    return {"op": op, "model": "llama3-8b", "batch": batch, "ctx": 32768, "latency_us": us}


def test_sweep_table_compares_every_read_under_every_configuration(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import sweep_table
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    runs = {  # config_10 sorts after config_2 by its number, not its text
        "config_1": {"rows": [_row("sdpa", 1, 50.0), _row("none", 1, 40.0), _row("sdpa", 16, 500.0),
                              _row("none", 16, 550.0)]},
        "config_2": {"rows": [_row("sdpa", 1, 52.0), _row("none", 1, 52.0), _row("sdpa", 16, 500.0),
                              _row("none", 16, 440.0)]},
        "config_10": {"rows": [_row("sdpa", 1, 50.0), _row("none", 1, 40.4), _row("sdpa", 16, 500.0),
                               {"op": "none", "model": "llama3-8b", "batch": 16, "ctx": 32768, "error": "oom"}]},
    }
    (tmp_path / "configs.json").write_text(json.dumps(runs))
    (tmp_path / "rows.md").write_text('## round 1 config {}\n| x |\n## round 1 config {"a": 1}\n'
                                      '## round 2 config {}\n')
    assert sweep_table.main([str(tmp_path / "configs.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == '| op | model | B | ctx | {} | {"a": 1} | {} (round 2) | fastest |'
    # B1: 40 (1.25x); 52 is +30.0 % (1.00x in its own run); 40.4 is +1.0 %; the fastest is the first
    assert out[2] == "| none | llama3-8b | 1 | 32k | 40.0, 1.25x | 52.0 (+30.0%), 1.00x | 40.4 (+1.0%), 1.24x | {} |"
    # B16: 550 (0.91x); 440 is -20.0 % (1.14x); the third run has no row
    assert out[3] == '| none | llama3-8b | 16 | 32k | 550.0, 0.91x | 440.0 (-20.0%), 1.14x | - | {"a": 1} |'
    # {"a": 1}: one faster, one slower; geometric mean of 1.3 and 0.8 = 1.020; below 1.0x: none
    assert '| {"a": 1} | 1 / 1 | 1.020 | 0 of 2 |' in out
    assert "| {} | - | - | 1 of 2 |" in out
    assert "| {} (round 2) | 0 / 0 | 1.010 | 0 of 2 |" in out
    assert "| the fastest of each read | - | - | 0 of 2 |" in out
    # {} and {} (round 2) agree within 10 % at B1 (40.0 / 40.4): no read is listed as unsteady
    assert not any(line.startswith("Rounds of one configuration") for line in out)


def test_rounds_of_one_configuration_that_disagree_are_listed(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import sweep_table
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    runs = {"config_1": {"rows": [_row("none", 16, 100.0), _row("lowrank", 16, 100.0)]},
            "config_2": {"rows": [_row("none", 16, 101.0), _row("lowrank", 16, 113.0)]},
            "config_3": {"rows": [_row("none", 16, 116.0), _row("lowrank", 16, 100.0)]},
            "config_4": {"rows": [_row("none", 16, 100.0), _row("lowrank", 16, 112.0)]}}
    (tmp_path / "configs.json").write_text(json.dumps(runs))
    (tmp_path / "rows.md").write_text("## round 1 config torch\n## round 1 config vmm\n"
                                      "## round 2 config torch\n## round 2 config vmm\n")
    assert sweep_table.main([str(tmp_path / "configs.json")]) == 0
    out = capsys.readouterr().out
    # torch: none 100 / 116 (+16 %) listed, lowrank 100 / 100 not; vmm: lowrank 113 / 112 agree, none 101 / 100 agree
    assert "- none llama3-8b B16 32k, torch: 100.0 / 116.0 µs" in out
    assert "lowrank llama3-8b B16 32k, torch" not in out and ", vmm:" not in out
    assert sweep_table.main([str(tmp_path / "configs.json"), "--state", "20"]) == 0
    assert "Rounds of one configuration" not in capsys.readouterr().out
