"""Run a test file's Triton kernel cases once, in a subprocess under the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before Triton's JIT decorators run, so the cases execute in a
child process (``python <test file> --worker OUT``) and report JSON results per case; the parent's
tests then assert on them.  Nothing leaks into the other tests' process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable


def collect(cases: dict[str, Callable[[], dict]], path: str) -> None:
    """Worker side: run every case, write ``{name: result or {"error": ...}}`` to ``path``."""
    results = {}
    for name, run in cases.items():
        try:
            results[name] = run()
        except Exception as exc:  # reported per case by the parent
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    Path(path).write_text(json.dumps(results))


def interpreted(test_file: str, out_dir: Path, **env: str) -> dict:
    """Parent side: run ``test_file --worker`` under ``TRITON_INTERPRET=1`` and load its results."""
    out = out_dir / "results.json"
    child_env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore", **env)
    proc = subprocess.run([sys.executable, test_file, "--worker", str(out)], env=child_env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())
