"""benchmarks/lane_plans.py (the split plans the results quote): it runs without a GPU, and each per-lane plan it
prints keeps the uniform plan where the per-warp cap binds and stays within the wave where it does not."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_lane_plans_prints_both_kernels_plans_within_their_budgets():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/lane_plans.py")], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    kivi = re.findall(r"^\| (\S+) \| (\d+) \| (\w+) \| .* \| (\d+) \| (\d+) \((\d+) CTAs\) \| ([\d/]+) \((\d+) CTAs\) \|$",
                      out, re.M)
    assert len(kivi) == 24, out
    for model, b, ctx, wave, uni, uni_ctas, per, per_ctas in kivi:
        counts = [int(x) for x in per.split("/")]
        if int(b) == 1 and ctx != "128k" or ctx == "4k" and int(b) < 64:  # the cap binds first: the uniform plan
            assert set(counts) == {int(uni)}, (model, b, ctx, per, uni)
        assert int(per_ctas) <= max(int(wave), int(uni_ctas)), (model, b, ctx)
        assert counts == sorted(counts, reverse=True), (model, b, ctx, per)  # wider lanes at least as many
    assert "| llama3-8b | 16 | 32k | [(96, 1), (64, 1), (32, 5)] | 528 | 5 (560 CTAs) | 6/5/4 (496 CTAs) |" in out
    leank = re.findall(r"^\| (leank\d+) \| (\S+) \| (\d+) \| (\w+) \| .* \| (\d+) \| (\d+) \| ([\d/-]+) \|$", out, re.M)
    assert len(leank) == 24, out
    assert ("leank70", "llama3-8b", "16", "32k", "264", "2", "3/3/2/2") in leank
    assert all(per == "-" for op, model, b, *_, per in leank if model == "llama3-8b" and b == "64")
