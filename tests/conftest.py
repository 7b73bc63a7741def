import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
