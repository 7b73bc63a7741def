"""Run a test file's Triton kernel cases once, in a subprocess under the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before Triton's JIT decorators run, so the cases execute in a
child process (``python <test file> --worker OUT``) and report JSON results per case; the parent's
tests then assert on them.  Nothing leaks into the other tests' process.

The interpreter runs a kernel in Python on one core while the parent only waits, so the worker shares the cases out
among :func:`workers` processes: once the test file is imported and its cases are built, it forks (the imports are
not paid again), and each process runs every case it is the first to claim (an exclusively created file per case,
in the file's order) - every case runs exactly once, in one process, whatever its cost.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

WORKERS = "KVCOMPRESS_TEST_INTERPRETER_WORKERS"  # processes per worker; default: the cores available, at most 4
TIMES = "KVCOMPRESS_TEST_CASE_TIMES"  # set: each case's seconds on stderr (python tests/test_x.py --worker OUT)


def workers() -> int:
    """Processes to run a file's cases in: the cores this process may use, at most 4 (``$KVCOMPRESS_TEST_INTERPRETER_
    WORKERS`` overrides; 1 runs them in the worker alone)."""
    if os.environ.get(WORKERS):
        return max(1, int(os.environ[WORKERS]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cores))


def _claim(claims: str, index: int) -> bool:
    """Whether this process is the first to take case ``index`` (``O_EXCL``: exactly one creator wins)."""
    try:
        os.close(os.open(os.path.join(claims, str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _run(cases: dict[str, Callable[[], dict]], claims: str | None, parent: int | None = None) -> dict:
    results = {}
    for index, (name, run) in enumerate(cases.items()):
        if parent is not None and os.getppid() != parent:
            break  # the worker that forked this process is gone (killed on a timeout): stop too
        if claims is not None and not _claim(claims, index):
            continue  # another process runs it
        start = time.perf_counter()
        try:
            results[name] = run()
        except Exception as exc:  # reported per case by the parent
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        if os.environ.get(TIMES):
            print(f"{time.perf_counter() - start:8.1f} s  {name}", file=sys.stderr, flush=True)
    return results


def collect(cases: dict[str, Callable[[], dict]], path: str) -> None:
    """Worker side: run every case, write ``{name: result or {"error": ...}}`` to ``path``."""
    n = min(int(os.environ.get(WORKERS, "1")), len(cases)) if hasattr(os, "fork") else 1
    if n <= 1:
        Path(path).write_text(json.dumps(_run(cases, None)))
        return
    claims = tempfile.mkdtemp(prefix="claims-", dir=os.path.dirname(os.path.abspath(path)))
    sys.stdout.flush()
    sys.stderr.flush()
    children, parent = {}, os.getpid()
    for i in range(1, n):
        pid = os.fork()
        if pid == 0:  # a forked worker: run its share, hand it over, leave without running the parent's code
            status = 1
            try:
                Path(f"{path}.{i}").write_text(json.dumps(_run(cases, claims, parent)))
                status = 0
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        children[pid] = i
    results = _run(cases, claims)
    for pid, i in children.items():
        _, status = os.waitpid(pid, 0)
        part = Path(f"{path}.{i}")
        if status == 0 and part.exists():
            results.update(json.loads(part.read_text()))
        part.unlink(missing_ok=True)
    # in the file's order; a case claimed by a process that died before reporting it is an error of that case
    results = {name: results.get(name, {"error": "the worker process running this case died"}) for name in cases}
    shutil.rmtree(claims, ignore_errors=True)
    Path(path).write_text(json.dumps(results))


def interpreted(test_file: str, out_dir: Path, **env: str) -> dict:
    """Parent side: run ``test_file --worker`` under ``TRITON_INTERPRET=1`` and load its results."""
    out = out_dir / "results.json"
    n = workers()
    child_env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore", **env)
    child_env[WORKERS] = str(n)
    if n > 1 and "OMP_NUM_THREADS" not in env:
        child_env["OMP_NUM_THREADS"] = "1"  # one core per process (and no OpenMP thread pool across the fork)
    proc = subprocess.run([sys.executable, test_file, "--worker", str(out)], env=child_env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())
