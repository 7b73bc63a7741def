import subprocess
import sys
from pathlib import Path

from kvcompress.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_validate_ok_and_error(tmp_path, capsys):
    assert main(["validate", str(ROOT / "examples/stacks/window.yaml")]) == 0
    assert "valid stack (window)" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("compressors:\n  - window: {recent: -5}\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "compressors[0].window.recent" in err and "got -5" in err


def test_plugins_lists_axis_and_source(capsys):
    assert main(["plugins", "--all"]) == 0
    out = capsys.readouterr().out
    assert "window" in out and "evict" in out and "built-in" in out and "recent (default 1024" in out


def test_console_script_is_installed():
    res = subprocess.run([sys.executable, "-m", "kvcompress.cli", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "generate" in res.stdout and "validate" in res.stdout
