import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# Intra-op threads: at most 2; under pytest-xdist (scripts/test.sh runs the whole suite with one worker per core) the
# cores are shared out among the workers, so that two workers on two cores do not run four threads.
torch.set_num_threads(max(1, min(2, _cores() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Under pytest-xdist, the controller converts the default model (once per machine, about 20 s; see
    kvcompress/models.py) before the workers start, so that they do not all convert it at the same time.  Without
    the package that ships the model nothing is done here: the tests that need it report that themselves."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return  # a worker, or no xdist
    import contextlib
    import io
    import time

    from kvcompress.models import converted_default_model

    start, log = time.monotonic(), io.StringIO()
    try:  # its progress bars would clutter the -q output
        with contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):
            converted_default_model()
    except Exception:  # noqa: BLE001 - no package, no space, ...: the tests that load the model fail or skip with it
        return
    if log.getvalue():
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"converted the default model for the workers ({time.monotonic() - start:.0f} s, once)")


@pytest.fixture(scope="session")
def triton_cuobjdump():
    """Triton's bundled ``cuobjdump`` (a disassembler for the CPU tests of compiled kernels), or None where Triton or
    the tool is missing."""
    try:
        import triton
    except ImportError:
        return None
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return tool if tool.is_file() and shutil.which(str(tool)) else None


@pytest.fixture
def one_thread():
    """One intra-op thread for a test of tiny single-token steps: they gain nothing from threads and lose much when
    the machine's cores are shared (use with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def stride_plugin(tmp_path_factory):
    """The example third-party plugin (tests/fixtures/kvcompress-stride), pip-installed into a temp dir."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(FIXTURES / "kvcompress-stride")],
        check=True,
    )
    return target


@pytest.fixture
def with_stride_plugin(stride_plugin):
    import importlib

    from kvcompress import manager

    sys.path.insert(0, str(stride_plugin))
    importlib.invalidate_caches()
    manager.reset_registry()
    try:
        yield stride_plugin
    finally:
        sys.path.remove(str(stride_plugin))
        sys.modules.pop("kvcompress_stride", None)
        importlib.invalidate_caches()
        manager.reset_registry()


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct), loaded once per session."""
    from kvcompress.models import load_model

    return load_model(None)
