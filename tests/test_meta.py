"""Meta-tests: the hook specification is the documented, tested plugin API; packaging maps folders."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import tomllib

from kvcompress import docgen, hookspecs

ROOT = Path(__file__).resolve().parents[1]


def test_every_hook_is_documented_with_args_and_returns():
    for name in docgen.hook_names():
        fn = getattr(hookspecs.CacheCompressor, name, None) or getattr(hookspecs.RegistrationSpec, name)
        doc = inspect.getdoc(fn) or ""
        assert "Called" in doc, f"{name}: say when it is called"
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        for p in params:
            assert p in doc, f"{name}: parameter {p} undocumented"
        assert ("Returns:" in doc) or ("Raises:" in doc), f"{name}: document the result"


def test_docs_hook_reference_is_generated_from_hookspecs():
    assert (ROOT / "docs" / "hooks.md").read_text() == docgen.render(), "run: python -m kvcompress.docgen > docs/hooks.md"


def test_every_hook_is_exercised_by_a_test_or_builtin():
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.name != "test_meta.py")
    sources += "\n".join(p.read_text() for p in (ROOT / "plugins").glob("*.py"))
    for name in docgen.hook_names():
        assert re.search(rf"def {name}\(", sources), f"no implementation of {name} is tested"


def test_packages_listed_in_pyproject_match_folders():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = cfg["package-dir"]
    listed = set(cfg["packages"])
    found = set()
    for pkg, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    assert found == listed


def test_no_top_level_plugins_or_kernels_module_is_importable():
    code = ("import importlib.util, sys; sys.path = [p for p in sys.path if p not in ('', '.')]; "
            "print(importlib.util.find_spec('plugins'), importlib.util.find_spec('kernels'), "
            "importlib.util.find_spec('kvcompress.plugins.window') is not None, "
            "importlib.util.find_spec('kvcompress.kernels.attention') is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd="/").stdout.split()
    assert out == ["None", "None", "True", "True"]


def test_import_has_no_side_effects():
    code = ("import sys, kvcompress; "
            "print('transformers' in sys.modules, 'kvcompress.plugins.window' in sys.modules, "
            "kvcompress.manager._REGISTRY is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True"]


def test_no_bare_plugins_or_kernels_imports():
    pattern = re.compile(r"^\s*(from|import)\s+(plugins|kernels)\b", re.M)
    for path in list(ROOT.glob("kvcompress/**/*.py")) + list(ROOT.glob("plugins/**/*.py")) + list(
            ROOT.glob("kernels/**/*.py")):
        assert not pattern.search(path.read_text()), path


def test_non_python_kernel_sources_ship_in_the_package():
    """Every non-Python file a kernel package reads at run time (e.g. a .cu source built at first use) is
    declared as package data, so a pip install has it (the KIVI v3 source was once missing from wheels)."""
    import fnmatch

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {pkg: ROOT / path for pkg, path in cfg["package-dir"].items()}
    data = cfg.get("package-data", {})
    missing = []
    for pkg in cfg["packages"]:
        root = next(k for k in sorted(dirs, key=len, reverse=True) if pkg == k or pkg.startswith(k + "."))
        folder = dirs[root].joinpath(*pkg[len(root):].strip(".").split(".")) if pkg != root else dirs[root]
        for f in folder.iterdir():
            if f.is_file() and f.suffix in (".cu", ".cuh", ".cpp", ".h") and \
                    not any(fnmatch.fnmatch(f.name, pat) for pat in data.get(pkg, [])):
                missing.append(f"{pkg}: {f.name}")
    assert not missing, f"declare these in [tool.setuptools.package-data]: {missing}"
