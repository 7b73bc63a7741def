"""Hostile but fair inputs (issue 20): every bad stack, file, plugin, argument or API call gets one clear
line before any work starts; nothing grows without bound; nothing wrong passes silently.

Table-driven: YAML stack files, calibration files, third-party plugins, command-line arguments, API misuse
and environment switches.  Every case asserts the exception type (or exit status), that the message is
one bounded line naming the key path / file / tensor / plugin with what is allowed and what was given, and
(for the command line) that no traceback is printed.  Resource caps on the validate path are measured
(peak resident memory, wall time) on inputs that would exceed them were the caps absent.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

import kvcompress
from kvcompress import CompressorSpec, ConfigError, Layout, PluginError, hookimpl
from kvcompress.errors import KVCompressWarning, UnsupportedOperationError
from kvcompress.registry import Registry
from kvcompress.stack import load_stack, parse_stack
from models import tiny_model

ROOT = Path(__file__).resolve().parents[1]
WINDOW = str(ROOT / "examples" / "stacks" / "window.yaml")
MAX_MESSAGE = 1500  # characters: every message is bounded whatever the input


def one_line(message: str, *fragments: str) -> str:
    """``message`` is one bounded line holding every fragment."""
    assert "\n" not in message and len(message) <= MAX_MESSAGE, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def cli_error(capsys, *fragments: str) -> str:
    """The command's stderr: one line, no traceback, every fragment in it."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[kvcompress]")]
    assert len(lines) == 1, err
    return one_line(lines[0], *fragments)


def peak_rss_growth(fn) -> tuple[int, float]:
    """(peak resident-memory growth in bytes while ``fn`` runs, seconds): the kernel's high-water mark is
    reset first (/proc/self/clear_refs), so the measurement covers ``fn`` alone."""
    def kib(field: str) -> int:
        return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = kib("VmRSS")
    t0 = time.perf_counter()
    fn()
    return (kib("VmHWM") - before) * 1024, time.perf_counter() - t0


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


# ============================================================================= YAML stack files

def _laughs(target: str) -> str:
    """Nine nested aliases of nine: 9^9 (387 million) nodes once expanded, 400 bytes on disk."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n" + target + "\n"


def _sparse(path: Path, size: int, head: bytes = b"") -> Path:
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(size)
    return path


YAML_CASES = [
    # (id, file content (bytes or text) or a builder(tmp_path) -> path, fragments of the one-line error)
    ("billion_laughs_description", _laughs("compressors: []\ndescription: *l8"),
     ["10,000 nodes once aliases are expanded", "billion laughs"]),
    ("billion_laughs_parameter", _laughs("compressors:\n  - window: {recent: *l8}"),
     ["10,000 nodes once aliases are expanded"]),
    ("many_nodes", "compressors: []\ndescription: [" + ", ".join(["0"] * 20_000) + "]\n",
     ["10,000 nodes", "a few dozen values"]),
    ("deep_flow_nesting", "compressors: " + "[" * 1000 + "]" * 1000 + "\n", ["nesting"]),
    ("deep_block_nesting", "".join(f"{'  ' * i}k{i}:\n" for i in range(40)) + "  " * 40 + "v\n",
     ["YAML nested at most 32 levels deep", "deeper nesting (line 33)"]),
    ("utf16", "compressors: []\n".encode("utf-16"), ["expected UTF-8 text, got UTF-16 text (byte-order mark)",
                                                     "iconv"]),
    ("utf32", "compressors: []\n".encode("utf-32"), ["UTF-32 text (byte-order mark)"]),
    ("binary", bytes(range(256)) * 4, ["expected UTF-8 text, got binary data (a NUL byte at offset 0)"]),
    ("invalid_utf8", b"compressors: []\nname: caf\xe9\n", ["expected UTF-8 text, got invalid UTF-8 at byte 25"]),
    ("control_character", "compressors: []\nname: a\x07b\n", ["valid YAML", "unacceptable character #x0007: control characters are not allowed (character 23)"]),
    ("list_as_key", "compressors: []\n? [a, b]\n: 1\n", ["valid YAML", "found a list key (line 2, column 3)"]),
    ("mapping_as_key", "compressors: []\n? {a: 1}\n: 1\n", ["valid YAML", "found a dict key"]),
    ("merge_of_a_scalar", "compressors:\n  - window: {<<: 5, recent: 8}\n", ["valid YAML", "for merging"]),
    ("duplicate_key", "compressors:\n  - window: {recent: 8, recent: 9}\n",
     ["valid YAML", "duplicate key 'recent' (line 2, column 25)"]),
    ("python_tag", "compressors: !!python/object/apply:os.system ['true']\n", ["valid YAML", "python/object"]),
    ("undefined_alias", "compressors: *nowhere\n", ["valid YAML", "found undefined alias 'nowhere'"]),
    ("two_documents", "compressors: []\n---\ncompressors: []\n", ["valid YAML", "a single document"]),
    ("huge_value_is_quoted_bounded", "compressors: []\nname: [" + ", ".join(["x" * 50] * 9000) + "]\n",
     ["name: expected a string, got ['xxxxxxxxxx", "..."]),
    ("huge_key_is_bounded", "compressors: []\n? " + "k" * 100_000 + "\n: 1\n",
     ["unknown key", "one of the top-level keys"]),
    ("too_large", lambda tmp: _sparse(tmp / "big.yaml", 4 << 30, b"compressors: []\n"),
     ["a YAML stack file of at most 1 MiB", "4,294,967,296 bytes", "exhaust memory"]),
    ("dev_zero", lambda tmp: "/dev/zero", ["a regular file (YAML stack file)", "got a character device"]),
    ("directory", lambda tmp: tmp, ["a regular file (YAML stack file)", "got a directory"]),
    ("fifo", lambda tmp: (os.mkfifo(tmp / "pipe"), tmp / "pipe")[1], ["got a FIFO (named pipe)"]),
    ("missing", lambda tmp: tmp / "absent.yaml", ["a readable YAML stack file", "No such file or directory"]),
]


@pytest.mark.parametrize("case,content,fragments", YAML_CASES, ids=[c[0] for c in YAML_CASES])
def test_hostile_yaml_is_refused_in_one_line(tmp_path, case, content, fragments):
    if callable(content):
        path = Path(content(tmp_path))
    else:
        path = tmp_path / f"{case}.yaml"
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_stack(path)
    assert time.perf_counter() - t0 < 5
    one_line(str(err.value), *fragments)
    if "key" not in case and "value" not in case:
        assert err.value.path == str(path)  # the file is named


YAML_ACCEPTED = [
    ("merge_keys_work", "compressors:\n  - window:\n      <<: {sinks: 2, recent: 8}\n      recent: 16\n",
     {"window": {"sinks": 2, "recent": 16}}),
    ("utf8_bom", "\ufeffcompressors:\n  - window: {recent: 8}\n", {"window": {"sinks": 4, "recent": 8}}),
    ("integer_for_a_float_parameter", "compressors:\n  - leank: {ratio: 1}\n", None),
    ("anchors_inside_the_stack", "compressors:\n  - kivi: &k {bits: 4, group: 32, residual: 32}\n", None),
]


@pytest.mark.parametrize("case,text,expected", YAML_ACCEPTED, ids=[c[0] for c in YAML_ACCEPTED])
def test_legitimate_yaml_features_still_work(tmp_path, case, text, expected):
    path = tmp_path / "s.yaml"
    path.write_bytes(text.encode("utf-8"))
    stack = load_stack(path)
    if expected is not None:
        assert stack.to_dict()["compressors"] == [expected]
    if case == "integer_for_a_float_parameter":
        assert stack.entries[0].config.ratio == 1.0 and isinstance(stack.entries[0].config.ratio, float)


def test_validate_caps_memory_and_time(tmp_path):
    """Measured caps of the validate path: a 4 GiB file, a 500 kB flow list of 250,000 items, a billion-laughs
    file and 10,000-level nesting each cost less than 50 MB and 2 s (uncapped: 4 GiB read; ~160 MB and 40 s
    of PyYAML nodes; a RecursionError)."""
    files = {
        "big": _sparse(tmp_path / "big.yaml", 4 << 30, b"compressors: []\ndescription: "),
        "list": tmp_path / "list.yaml", "laughs": tmp_path / "laughs.yaml", "deep": tmp_path / "deep.yaml"}
    files["list"].write_text("compressors: []\ndescription: [" + ",".join(["0"] * 250_000) + "]\n")
    files["laughs"].write_text(_laughs("compressors: []\ndescription: *l8"))
    files["deep"].write_text("compressors:\n  - window: " + "{a: " * 10_000 + "1" + "}" * 10_000 + "\n")
    for name, path in files.items():
        def run():
            with pytest.raises(ConfigError):
                load_stack(path)

        grown, seconds = peak_rss_growth(run)
        assert grown < 50 << 20 and seconds < 2, (name, grown, seconds)


# ============================================================================= calibration files

@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """Valid files of every format for the tiny llama, and a rewriter that makes corrupted copies."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kvcompress.calibration.doublesparse import rank_channels, save_channels
    from kvcompress.calibration.lowrank import save_basis
    from kvcompress.calibration.masks import config_hash, rope_mask, save_mask

    cfg = tiny_model("llama").config
    d = tmp_path_factory.mktemp("calib")
    files = {"leank": d / "mask.safetensors", "lowrank": d / "basis.safetensors",
             "double_sparse": d / "channels.safetensors"}
    save_mask(files["leank"], rope_mask(cfg, 0.5, 4), {"model": "tiny", "model_config_hash": config_hash(cfg),
                                                       "ratio": 0.5, "align": 4, "sinks": 1, "local": 1,
                                                       "method": "rope", "settings": {}})
    vectors = torch.linalg.qr(torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(0)))[0]
    save_basis(files["lowrank"], vectors, torch.full((2, 2), 8, dtype=torch.int32), torch.rand(2, 2, 16),
               {"model": "tiny", "model_config_hash": config_hash(cfg), "align": 8, "settings": {}})
    scores = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(1))
    save_channels(files["double_sparse"], rank_channels(scores, 8), scores, cfg, "tiny", {"windows": 1})

    def rewrite(kind: str, out: Path, change) -> Path:
        with safe_open(str(files[kind]), framework="pt") as fh:
            tensors = {n: fh.get_tensor(n) for n in fh.keys()}
            meta = dict(fh.metadata())
        change(tensors, meta)
        save_file(tensors, str(out), metadata=meta)
        return out

    return files, rewrite


KEYS = {"leank": "mask", "lowrank": "basis", "double_sparse": "channels"}
MAIN = {"leank": "keep", "lowrank": "basis", "double_sparse": "channels"}


def _set(name, value):
    return lambda t, m: t.__setitem__(name, value(t[name]) if callable(value) else value)


def _meta(key, value):
    return lambda t, m: m.__setitem__(key, value)


def _raw(data: bytes):
    return ("raw", data)


CALIBRATION_CASES = [
    # (id, kinds, corruption: rewrite(tensors, meta) / ("raw", bytes) / "directory" / "missing", fragments)
    ("text_file", ("leank", "lowrank", "double_sparse"), _raw(b"root:x:0:0:root:/root:/bin/bash\n" * 3),
     ["a safetensors file of format", "unreadable (SafetensorError"]),
    ("header_claims_1_TiB", ("lowrank",), _raw((1 << 40).to_bytes(8, "little") + b"{}"),
     ["unreadable (SafetensorError", "header too large"]),
    ("truncated", ("double_sparse",), "truncate", ["unreadable (SafetensorError"]),
    ("wrong_format_tag", ("leank", "lowrank", "double_sparse"), _meta("format", "something/else"),
     ["of format 'kvcompress.", "got something/else"]),
    ("missing_tensor", ("leank", "lowrank", "double_sparse"), lambda t, m: t.pop(MAIN[m["_kind"]]),
     ["(missing: "]),
    ("unknown_tensor", ("leank", "lowrank", "double_sparse"), _set("payload", torch.zeros(3)),
     ["(unknown: payload)"]),
    ("integer_basis", ("lowrank",), _set("basis", lambda x: x.to(torch.int32)),
     ["tensor 'basis' as a float tensor of rank 4, got I32 of shape (2, 2, 16, 8)"]),
    ("float_keep", ("leank",), _set("keep", lambda x: x.float()), ["tensor 'keep' as U8 tensor of rank 3, got F32"]),
    ("float_channels", ("double_sparse",), _set("channels", lambda x: x.float()),
     ["tensor 'channels' as an integer tensor of rank 3, got F32"]),
    ("rank_of_basis", ("lowrank",), _set("basis", lambda x: x[0]), ["tensor 'basis' as a float tensor of rank 4"]),
    ("nan_basis", ("lowrank",), _set("basis", lambda x: x.index_fill(3, torch.tensor([0]), float("nan"))),
     ["finite values in tensor 'basis'", "64 NaN or infinite values of 512"]),
    ("inf_scores", ("double_sparse",), _set("scores", lambda x: x.index_fill(0, torch.tensor([1]), float("inf"))),
     ["finite values in tensor 'scores'", "32 NaN or infinite values"]),
    ("nan_alpha", ("leank",), _set("alpha", torch.full((2, 2, 16), float("nan"))), ["finite values in tensor 'alpha'"]),
    ("settings_not_json", ("leank", "lowrank", "double_sparse"), _meta("settings", "{not json"),
     ["metadata 'settings' as a JSON object", "got '{not json'"]),
    ("geometry_not_an_object", ("lowrank", "double_sparse"), _meta("model_geometry", "[1, 2]"),
     ["metadata 'model_geometry' as a JSON object"]),
    ("settings_nested_30000_deep", ("double_sparse",), _meta("settings", "[" * 30_000 + "]" * 30_000),
     ["metadata 'settings' as a JSON object"]),
    ("settings_of_1_MB", ("leank",), _meta("settings", json.dumps({"x": "y" * (1 << 20)})),
     ["at most 65,536 characters"]),
    ("align_not_an_integer", ("leank", "lowrank"), _meta("align", "sixteen"), ["metadata 'align' as an integer"]),
    ("ratio_not_finite", ("leank",), _meta("ratio", "nan"), ["metadata 'ratio' as a finite number"]),
    ("metadata_missing", ("leank",), lambda t, m: m.pop("sinks"), ["with the metadata", "none for sinks"]),
    ("keep_not_binary", ("leank",), _set("keep", lambda x: x * 2), ["values other than 0 and 1"]),
    ("rank_zero", ("lowrank",), _set("rank", lambda x: x * 0), ["rank [L, H] (1..R)"]),
    ("channel_out_of_range", ("double_sparse",), _set("channels", lambda x: x + 99), ["indices out of range"]),
    ("directory", ("leank", "lowrank", "double_sparse"), "directory", ["an existing"]),
    ("missing", ("leank", "lowrank", "double_sparse"), "missing", ["an existing"]),
]
CALIBRATION_PARAMS = [(case, kind, corrupt, fragments) for case, kinds, corrupt, fragments in CALIBRATION_CASES
                      for kind in kinds]


def _corrupt(calibration, tmp_path, kind, corrupt) -> Path:
    files, rewrite = calibration
    out = tmp_path / f"{kind}.safetensors"
    if corrupt == "directory":
        out.mkdir()
    elif corrupt == "missing":
        pass
    elif corrupt == "truncate":
        data = files[kind].read_bytes()
        out.write_bytes(data[: len(data) // 2])
    elif isinstance(corrupt, tuple):
        out.write_bytes(corrupt[1])
    else:
        def change(t, m, _corrupt=corrupt):
            m["_kind"] = kind
            _corrupt(t, m)
            m.pop("_kind")

        rewrite(kind, out, change)
    return out


@pytest.mark.parametrize("case,kind,corrupt,fragments", CALIBRATION_PARAMS,
                         ids=[f"{p[0]}-{p[1]}" for p in CALIBRATION_PARAMS])
def test_bad_calibration_file_is_refused_at_validate_time(calibration, tmp_path, case, kind, corrupt, fragments):
    path = _corrupt(calibration, tmp_path, kind, corrupt)
    key = f"compressors[0].{kind}.{KEYS[kind]}"
    with pytest.raises(ConfigError) as err:
        parse_stack({"compressors": [{kind: {KEYS[kind]: str(path)}}]})  # no model anywhere
    assert err.value.path == key
    one_line(str(err.value), key, str(path), *fragments)


@pytest.mark.parametrize("kind", list(KEYS))
def test_valid_calibration_files_validate_and_load(calibration, model, kind):
    files, _ = calibration
    stack = parse_stack({"compressors": [{kind: {KEYS[kind]: str(files[kind])}}]})
    kvcompress.Cache(stack, model)  # the model-dependent checks pass too


def test_oversized_calibration_file_is_refused_unread(tmp_path):
    """A sparse 1 GiB + 1 MiB file with a valid header for one uint8 tensor filling it: refused by size before
    safetensors maps it (uncapped: 1 GiB copied into a tensor)."""
    from kvcompress.calibration.masks import FORMAT

    size = (1 << 30) + (1 << 20)
    header = json.dumps({"__metadata__": {"format": FORMAT}, "keep": {"dtype": "U8", "shape": [1, 1, 0],
                                                                       "data_offsets": [0, 0]}}).encode()
    n = size - 8 - len(header) - 64
    header = json.dumps({"__metadata__": {"format": FORMAT},
                         "keep": {"dtype": "U8", "shape": [1, 1, n], "data_offsets": [0, n]}}).encode()
    header += b" " * (size - 8 - len(header) - n)
    path = _sparse(tmp_path / "huge.safetensors", size, len(header).to_bytes(8, "little") + header)

    def run():
        with pytest.raises(ConfigError) as err:
            parse_stack({"compressors": [{"leank": {"mask": str(path)}}]})
        one_line(str(err.value), "compressors[0].leank.mask", "of at most 1024 MiB", "1,074,790,400 bytes")

    grown, seconds = peak_rss_growth(run)
    assert grown < 50 << 20 and seconds < 2, (grown, seconds)


# ============================================================================= third-party plugins

@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    """Installs fake distributions (dist-info with a 'kvcompress' entry point + module) on sys.path."""
    from kvcompress import manager

    site = tmp_path / "site"
    site.mkdir()
    modules = []

    def install(dist: str, entry: str, module: str, source: str) -> None:
        info = site / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[kvcompress]\n{entry} = {module}\n")
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        modules.append(module)
        importlib.invalidate_caches()
        manager.reset_registry()

    monkeypatch.syspath_prepend(str(site))
    yield install, site
    for module in modules:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()
    manager.reset_registry()


_SPEC = """
import dataclasses
from kvcompress import Compressor, CompressorSpec, Layout, hookimpl, param

@dataclasses.dataclass(frozen=True)
class Cfg:
    n: int = param(1, "n", min=0)

class Comp(Compressor):
    @hookimpl
    def kvcompress_layer_layout(self, layer):
        return Layout()
"""

PLUGIN_CASES = [
    # (id, entry point name, module source, fragments of the warning and of the refusal of a stack naming it)
    ("import_error", "brokenimport", "import kvcompress_no_such_module_xyz\n",
     ["import failed: ModuleNotFoundError: No module named 'kvcompress_no_such_module_xyz'"]),
    ("syntax_error", "brokensyntax", "def broken(:\n", ["import failed: SyntaxError"]),
    ("bad_signature", "badsig", "from kvcompress import hookimpl\n@hookimpl\n"
     "def kvcompress_register_compressors(register, extra):\n    pass\n",
     ["breaks the hook specification", "{'extra'}"]),
    ("unknown_hook", "typo", "from kvcompress import hookimpl\n@hookimpl\n"
     "def kvcompress_register_compresors(register):\n    pass\n",
     ["implements unknown hook(s) kvcompress_register_compresors"]),
    ("register_raises", "raiser", "from kvcompress import hookimpl\n@hookimpl\n"
     "def kvcompress_register_compressors(register):\n    raise RuntimeError('boom at registration')\n",
     ["kvcompress_register_compressors raised RuntimeError: boom at registration"]),
    ("not_a_spec", "notspec", "from kvcompress import hookimpl\n@hookimpl\n"
     "def kvcompress_register_compressors(register):\n    register('notspec')\n",
     ["register() expects a CompressorSpec, got str"]),
    ("bad_axis", "sideways", _SPEC + "@hookimpl\ndef kvcompress_register_compressors(register):\n"
     "    register(CompressorSpec(name='sideways', axis='sideways', config=Cfg, factory=Comp))\n",
     ["PluginError: compressor 'sideways' declares axis 'sideways'; allowed axes: evict"]),
    ("name_collision", "mywindow", _SPEC + "@hookimpl\ndef kvcompress_register_compressors(register):\n"
     "    register(CompressorSpec(name='window', axis='evict', config=Cfg, factory=Comp))\n"
     "    register(CompressorSpec(name='mywindow2', axis='evict', config=Cfg, factory=Comp))\n",
     ["compressor 'window' is registered by built-in and by kvcompress-hostile-mywindow 1.0; neither is used",
      "KVCOMPRESS_BLOCK_PLUGINS"]),
]


@pytest.mark.parametrize("case,entry,source,fragments", PLUGIN_CASES, ids=[c[0] for c in PLUGIN_CASES])
def test_broken_plugin_is_named_skipped_and_the_rest_works(plugin_site, case, entry, source, fragments):
    from kvcompress import manager

    install, _ = plugin_site
    dist, module = f"kvcompress-hostile-{entry}", f"kvc_hostile_{case}"
    install(dist, entry, module, source)
    with pytest.warns(KVCompressWarning) as record:
        registry = manager.get_registry()
    messages = [str(w.message) for w in record if issubclass(w.category, KVCompressWarning)]
    assert len(messages) == 1, messages  # one line per skipped plugin
    one_line(messages[0], f"plugin entry point '{entry} = {module}' of {dist} 1.0 was skipped", *fragments)
    # every other stack keeps working, built-ins included
    other = "kivi" if case == "name_collision" else "window"
    assert registry.get(other).source == "built-in"
    parse_stack({"compressors": [{other: {}}]})
    # a stack naming what the broken plugin provides fails with that message
    named = "window" if case == "name_collision" else entry
    with pytest.raises(ConfigError) as err:
        parse_stack({"compressors": [{named: {}}]})
    one_line(str(err.value), f"compressors[0].{named}", *fragments)
    if case == "name_collision":
        assert registry.get("mywindow2").source == f"{dist} 1.0"  # its other compressors stay usable


# ----------------------------------------------------------------------------- hooks that raise

@dataclasses.dataclass(frozen=True)
class _NoParams:
    pass


class _BoomLater(kvcompress.Compressor):
    """Keeps a small window; its evict hook raises on the first block that leaves it (mid-generation)."""

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        return Layout(sinks=2, recent=8, flush=4)

    @hookimpl
    def kvcompress_evict_tokens(self, layer, block):
        raise ZeroDivisionError("boom in the middle of generation")


class _BoomLayout(kvcompress.Compressor):
    @hookimpl
    def kvcompress_layer_layout(self, layer):
        raise KeyError("no layout for you")


class _BoomValidate(kvcompress.Compressor):
    @hookimpl
    def kvcompress_validate_stack(self, entries):
        raise IndexError("validation bug")


class _BoomStore(kvcompress.Compressor):
    """Its middle store (plugin code the layer calls directly, not a hook) raises when a block arrives."""

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        return Layout(sinks=2, recent=8, flush=4)

    @hookimpl
    def kvcompress_quantize_store(self, layer):
        from kvcompress.state import DenseStore

        class BrokenStore(DenseStore):
            def append(self, block):
                raise RuntimeError("store is full of bugs")

        return BrokenStore()


def _stack_of(factory, name: str = "boom", axis: str = "evict"):
    reg = Registry()
    reg.add(CompressorSpec(name=name, axis=axis, config=_NoParams, factory=factory), "test")
    return parse_stack({"compressors": [{name: {}}]}, registry=reg)


HOOK_CASES = [
    ("generate_in_scope", "kvcompress_evict_tokens", "ZeroDivisionError: boom in the middle of generation"),
    ("generate_bare_cache", "kvcompress_evict_tokens", "ZeroDivisionError: boom in the middle of generation"),
    ("cache_build", "kvcompress_layer_layout", "KeyError: 'no layout for you'"),
    ("stack_validation", "kvcompress_validate_stack", "IndexError: validation bug"),
    ("store_append", None, "the middle store BrokenStore raised in append: RuntimeError: store is full of bugs"),
]


@pytest.mark.parametrize("case,hook,error", HOOK_CASES, ids=[c[0] for c in HOOK_CASES])
def test_hook_that_raises_is_one_plugin_error_and_the_model_is_restored(model, case, hook, error):
    before = model.config._attn_implementation
    ids = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    generate = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    cache = None
    with pytest.raises(PluginError) as err:
        if case == "stack_validation":
            _stack_of(_BoomValidate)
        elif case == "cache_build":
            kvcompress.Cache(_stack_of(_BoomLayout), model)
        elif case == "generate_bare_cache":
            cache = kvcompress.Cache(_stack_of(_BoomLater), model)
            model.generate(ids, cache=cache, **generate)
        elif case == "store_append":
            with kvcompress.compress(model, _stack_of(_BoomStore, axis="quantize")) as cache:
                model.generate(ids, cache=cache, **generate)
        else:
            with kvcompress.compress(model, _stack_of(_BoomLater)) as cache:
                model.generate(ids, cache=cache, **generate)
    assert type(err.value) is PluginError and err.value.__cause__ is not None
    one_line(str(err.value), f"compressor 'boom' (test) raised in hook {hook}: {error}" if hook else error)
    assert model.config._attn_implementation == before
    if cache is not None:  # the cache is marked unusable: reusing it is refused, in the scope or not
        with pytest.raises(PluginError) as again:
            with kvcompress.compress(model, "examples/stacks/none.yaml"):
                model(ids, cache=cache)
        one_line(str(again.value), "this kvcompress cache is unusable", error)
        assert model.config._attn_implementation == before


# ============================================================================= command line

@pytest.fixture
def no_model_load(monkeypatch):
    """Every refusal below must come before a model loads."""
    import kvcompress.models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(kvcompress.models, "load_model", refuse)
    monkeypatch.setattr(kvcompress.models.hf, "load_pretrained", refuse)


def _run(argv: list[str]) -> int:
    from kvcompress.cli import main

    try:
        return main(argv)
    except SystemExit as exc:  # argparse
        return exc.code


def _paths(tmp: Path) -> dict[str, str]:
    (tmp / "file.txt").write_text("x")
    (tmp / "empty_dir").mkdir(exist_ok=True)
    (tmp / "laughs.yaml").write_text(_laughs("compressors: []\ndescription: *l8"))
    return {"FILE": str(tmp / "file.txt"), "EMPTY": str(tmp / "empty_dir"), "TMP": str(tmp),
            "MISSING": str(tmp / "no_such_dir"), "LAUGHS": str(tmp / "laughs.yaml"), "W": WINDOW}


CLI_CASES = [
    # (argv with {PLACEHOLDERS}, exit status, fragments of the one stderr line)
    ("generate --max-new-tokens 0 hi", 2,
     ["kvcompress generate: error: argument --max-new-tokens: expected an integer in [1, 1048576], got '0'",
      "(see kvcompress generate --help)"]),
    ("generate --max-new-tokens -5 hi", 2, ["argument --max-new-tokens: expected an integer in [1, 1048576], "
                                            "got '-5'"]),
    ("generate --max-new-tokens ten hi", 2, ["argument --max-new-tokens", "got 'ten'"]),
    ("generate --seed -1 hi", 2, ["argument --seed: expected an integer in [0, 9223372036854775807], got '-1'"]),
    ("generate --truncate middle hi", 2, ["argument --truncate: invalid choice: 'middle'"]),
    ("generate --model /no/such/dir/model hi", 2,
     ["--model: expected a model folder (holding config.json), a hub id such as org/name, or 'default', "
      "got '/no/such/dir/model'. no such folder"]),
    ("generate --model {FILE} hi", 2, ["--model: expected a model folder", "it is a file, not a folder"]),
    ("generate --model {EMPTY} hi", 2, ["--model: expected a model folder", "the folder has no config.json"]),
    ("generate --stack {LAUGHS} hi", 2, ["laughs.yaml: expected YAML of at most 10,000 nodes"]),
    ("generate --stack {W}", 2, ["the following arguments are required: PROMPT"]),
    ("generate", 2, ["the following arguments are required: PROMPT"]),
    ("validate {W} {W}", 2, ["unrecognized arguments"]),
    ("eval --stack {W} --task ppl --json {MISSING}/out.json", 2,
     ["--json: expected a path in an existing folder", "create", "no_such_dir first"]),
    ("eval --stack {W} --task ppl --json {TMP}", 2, ["--json: expected a file path", "it is a directory"]),
    ("eval --sweep {W} {W} --task ppl --plot {MISSING}/p.png", 2, ["--plot: expected a path in an existing folder"]),
    ("eval --stack {W} --task ppl --model /no/such/model", 2, ["--model: expected a model folder"]),
    ("eval --stack {W} --task ppl --context 0", 2, ["--context: expected an integer in"]),
    ("bench --stack {W} --json {MISSING}/b.json", 2, ["--json: expected a path in an existing folder"]),
    ("bench --stack {W} --steps 0", 2, ["--steps: expected an integer in [1, 131072], got 0"]),
    ("calibrate doublesparse --channels 8 --out x.txt", 2,
     ["--out: expected a path ending in .safetensors, got 'x.txt'"]),
    ("calibrate lowrank --rank 8 --out {FILE}/x.safetensors", 2, ["--out: expected a path in an existing folder",
                                                                  "file.txt is not a folder"]),
    ("calibrate leank --ratio 0.5 --align 16 --out {TMP}/m.safetensors --model /no/such/model", 2,
     ["--model: expected a model folder"]),
    ("calibrate leank --ratio 2 --align 16 --out {TMP}/m.safetensors", 2, ["ratio"]),
]


@pytest.mark.parametrize("argv,status,fragments", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_bad_command_line_gets_one_line_before_any_work(tmp_path, capsys, no_model_load, argv, status, fragments):
    args = [a.format(**_paths(tmp_path)) for a in argv.split()]
    assert _run(args) == status
    cli_error(capsys, *fragments)


def test_cache_folder_that_is_a_file_is_refused_before_conversion(tmp_path, capsys, monkeypatch):
    import kvcompress.models

    monkeypatch.setattr(kvcompress.models.hf, "load_pretrained", lambda *a, **k: pytest.fail("model loaded"))
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("KVCOMPRESS_CACHE", str(tmp_path / "cache"))
    assert _run(["generate", "hi"]) == 2
    cli_error(capsys, f"KVCOMPRESS_CACHE: expected a folder, or a path where one can be created, got "
                      f"'{tmp_path / 'cache'}'", "not a folder")


@pytest.fixture
def tiny_generate(monkeypatch, model):
    """``kvcompress generate`` on the tiny llama (1024 positions) with a byte tokenizer; records the prompt ids."""
    import kvcompress.models
    from test_eval_cli import ByteTokenizer

    seen = []
    original = type(model).generate

    def spy(self, *args, **kwargs):
        seen.append(kwargs["input_ids"][0].tolist())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", spy)
    monkeypatch.setattr(kvcompress.models, "load_model", lambda name=None, dtype=None, device=None:
                        (model, ByteTokenizer()))
    return seen


PROMPT = "".join(chr(ord("a") + i % 26) for i in range(1500))


@pytest.mark.parametrize("truncate", [None, "left", "right"])
def test_over_long_prompt_is_refused_or_truncated_as_chosen(tiny_generate, capsys, truncate):
    argv = ["generate", "--max-new-tokens", "8", "--dtype", "float32", "--stack", WINDOW, PROMPT]
    if truncate is None:
        assert _run(argv) == 2
        cli_error(capsys, "PROMPT: expected at most 1,016 tokens (max_position_embeddings 1,024 - --max-new-tokens "
                          "8), got 1,500 tokens", "--truncate left (keep its end)")
        assert tiny_generate == []  # refused before any prefill
        return
    assert _run(argv[:1] + ["--truncate", truncate] + argv[1:]) == 0
    err = capsys.readouterr().err
    assert f"[kvcompress] prompt truncated ({truncate}): 1,500 -> 1,016 tokens" in err and "Traceback" not in err
    kept = PROMPT[-1016:] if truncate == "left" else PROMPT[:1016]
    assert tiny_generate == [list(kept.encode())]


def test_max_new_tokens_beyond_the_model_is_refused(tiny_generate, capsys):
    assert _run(["generate", "--max-new-tokens", "1024", "hi"]) == 2
    cli_error(capsys, "--max-new-tokens: expected fewer than the model's max_position_embeddings (1024), got 1024")
    assert tiny_generate == []


@pytest.mark.parametrize("argv,fragment", [
    ("eval --stack {W} --task agreement --context 1020 --tokens 8 --compile --dtype float32 --quiet",
     "--context: expected with --compile, context + tokens within the model's 1024 positions"),
    ("bench --stack {W} --context 1000 --steps 32 --compile --dtype float32 --quiet",
     "--context: expected with --compile, context + steps + 2 <= the model's 1024 positions"),
])
def test_compiled_capacity_beyond_the_model_is_refused_before_running(tiny_generate, capsys, argv, fragment):
    assert _run(argv.format(W=WINDOW).split()) == 2
    cli_error(capsys, fragment, "got 10")


def _cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcompress.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_console_exit_status_and_no_traceback(tmp_path, plugin_site):
    """The few cases that need a real process: exit status, stderr lines, no traceback."""
    laughs = tmp_path / "laughs.yaml"
    laughs.write_text(_laughs("compressors: []\ndescription: *l8"))
    install, site = plugin_site
    install("kvcompress-hostile-cli", "clibroken", "kvc_hostile_cli", "import kvcompress_no_such_module_xyz\n")
    runs = [
        (_cli("validate", str(laughs)), 2, ["kvcompress: error: ", "10,000 nodes once aliases are expanded"]),
        (_cli("generate", "--max-new-tokens", "0", "hi"), 2, ["argument --max-new-tokens", "got '0'"]),
        (_cli("validate", WINDOW, env={"KVCOMPRESS_KERNELS": "fast"}), 2,
         ["kvcompress: error: KVCOMPRESS_KERNELS: expected one of 'auto', 'reference', 'triton', got 'fast'"]),
        (_cli("validate", WINDOW, env={"PYTHONPATH": str(site)}), 0,
         ["kvcompress: warning: plugin entry point 'clibroken = kvc_hostile_cli' of kvcompress-hostile-cli 1.0 was "
          "skipped: import failed: ModuleNotFoundError"]),
    ]
    for res, status, fragments in runs:
        assert res.returncode == status, res.stderr
        assert "Traceback" not in res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        one_line(lines[0], *fragments)
    assert "valid stack (window)" in runs[-1][0].stdout


# ============================================================================= API misuse

def _ids(batch: int = 1, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


WINDOW_SMALL = {"compressors": [{"window": {"sinks": 2, "recent": 4}}]}


def test_bare_cache_refuses_a_left_padded_batch_at_once(model):
    ids, mask = _ids(2), torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    calls = []
    handle = model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(UnsupportedOperationError) as err:
            model.generate(ids, attention_mask=mask, cache=kvcompress.Cache(WINDOW_SMALL, model), max_new_tokens=3)
        assert calls == []  # refused inside the first layer of the prefill, no logits computed
        one_line(str(err.value), "left-padded", "with kvcompress.compress(model, stack) as cache")
        assert type(err.value) is UnsupportedOperationError
        # what the bare cache can serve still works: an unpadded batch, and a padded one with no compression
        model.generate(ids, attention_mask=torch.ones_like(mask), cache=kvcompress.Cache(WINDOW_SMALL, model),
                       max_new_tokens=3)
        model.generate(ids, attention_mask=mask, cache=kvcompress.Cache(None, model), max_new_tokens=3)
    finally:
        handle.remove()


def _other_geometry():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=1024)
    return tf.LlamaForCausalLM(cfg).eval()


TWO_MODELS = [
    ("more_layers", lambda m: tiny_model("llama", layers=3), "bare",
     "passes layer 2, but the cache has 2 layers"),
    ("other_geometry", lambda m: _other_geometry(), "bare",
     "passes keys of shape (1, 4, 12, 16), but the cache holds 2 KV heads x head_dim 16"),
    ("other_dtype", lambda m: copy.deepcopy(m).to(torch.bfloat16), "bare",
     "passes torch.bfloat16 keys, but the cache holds torch.float32"),
    ("outside_the_scope", lambda m: tiny_model("llama", seed=1), "scope",
     "layer 0 of this kvcompress cache was never read by kvcompress attention"),
    ("both_attached", lambda m: tiny_model("llama", seed=1), "both",
     "a kvcompress cache built for one model is read by another model's attention"),
]


@pytest.mark.parametrize("case,make,mode,fragment", TWO_MODELS, ids=[c[0] for c in TWO_MODELS])
def test_one_cache_refuses_a_second_model(model, case, make, mode, fragment):
    other, ids = make(model), _ids()
    before = (model.config._attn_implementation, other.config._attn_implementation)
    with pytest.raises(UnsupportedOperationError) as err:
        if mode == "bare":
            cache = kvcompress.Cache(WINDOW_SMALL, model)
            model(ids, cache=cache)  # the cache now holds this model's keys
            other(ids, cache=cache)
        elif mode == "scope":
            with kvcompress.compress(model, WINDOW_SMALL) as cache:
                other(ids, cache=cache)
        else:
            with kvcompress.compress(model, WINDOW_SMALL) as cache, kvcompress.compress(other, WINDOW_SMALL):
                other(ids, cache=cache)
    one_line(str(err.value), fragment, "one model")
    assert (model.config._attn_implementation, other.config._attn_implementation) == before


SIZES = [
    # (id, stack entry, Cache keyword arguments or None (parse only), key path, fragment)
    ("sinks_beyond_documented_max", {"window": {"sinks": 2**21}}, None, "compressors[0].window.sinks",
     "expected an integer in [0, 1048576], got 2097152"),
    ("recent_beyond_documented_max", {"window": {"recent": 2**25}}, None, "compressors[0].window.recent",
     "in [1, 16777216], got 33554432"),
    ("k_beyond_documented_max", {"double_sparse": {"k": 2**25}}, None, "compressors[0].double_sparse.k",
     "got 33554432"),
    ("ratio_above_one", {"leank": {"ratio": 1.5}}, None, "compressors[0].leank.ratio", "in [0.0, 1.0], got 1.5"),
    ("integer_of_400_digits", {"window": {"recent": 10**400}}, None, "compressors[0].window.recent",
     "got 100000000000000000...0000000000000000000"),
    ("float_parameter_of_400_digits", {"leank": {"ratio": 10**400}}, None, "compressors[0].leank.ratio",
     "a number in [0.0, 1.0]"),
    ("sinks_beyond_model_positions", {"window": {"sinks": 2048, "recent": 8}}, {}, "compressors[0].window.sinks",
     "at most the model's max_position_embeddings (1024) tokens, got 2048"),
    ("flush_beyond_model_positions", {"leank": {"flush": 4096}}, {}, "compressors[0].leank.flush",
     "at most the model's max_position_embeddings (1024) tokens, got 4096"),
    ("max_cache_len_beyond_positions", {"window": {}}, {"max_cache_len": 10**6}, "max_cache_len",
     "a positive integer <= 1024 (the model's max_position_embeddings) (or None), got 1000000"),
    ("max_batch_size_beyond_max", {"window": {}}, {"max_cache_len": 64, "max_batch_size": 2**17}, "max_batch_size",
     "a positive integer <= 65536 (or None), got 131072"),
    ("max_cache_len_not_an_int", {"window": {}}, {"max_cache_len": True}, "max_cache_len", "got True"),
]


@pytest.mark.parametrize("case,entry,kwargs,path,fragment", SIZES, ids=[c[0] for c in SIZES])
def test_sizes_beyond_documented_maxima_or_the_model_are_refused(model, case, entry, kwargs, path, fragment):
    with pytest.raises(ConfigError) as err:
        stack = parse_stack({"compressors": [entry]})
        assert kwargs is not None, "parse_stack accepted it"
        kvcompress.Cache(stack, model, **kwargs)  # refused before anything is allocated
    assert err.value.path == path
    one_line(str(err.value), f"{path}: expected", fragment)


def test_threads_sharing_one_model_keep_it_attached_until_the_last_scope_exits(model):
    """Two threads' compress() scopes over one model overlap: both generate what a lone scope generates; the
    model stays on kvcompress attention until the last scope exits, then gets its own attention back."""
    ids = _ids(1, 10)
    generate = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    before = model.config._attn_implementation
    with kvcompress.compress(model, WINDOW_SMALL) as cache:
        expected = model.generate(ids, cache=cache, **generate)
    both_inside, first_left = threading.Barrier(2, timeout=60), threading.Event()
    results, seen, errors = {}, {}, []

    def worker(name: str) -> None:
        try:
            with kvcompress.compress(model, WINDOW_SMALL) as cache:
                both_inside.wait()
                results[name] = model.generate(ids, cache=cache, **generate)
                if name == "second":
                    first_left.wait(60)
                    seen["after first left"] = model.config._attn_implementation
                    with kvcompress.compress(model, WINDOW_SMALL) as again:
                        results["after"] = model.generate(ids, cache=again, **generate)
            if name == "first":
                first_left.set()
        except BaseException as exc:  # reported below
            errors.append(exc)
            first_left.set()

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert seen["after first left"] == "kvcompress"
    for name in ("first", "second", "after"):
        assert torch.equal(results[name], expected), name
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("capacity", [None, 64])
def test_dropped_caches_free_their_memory_without_the_garbage_collector(model, capacity):
    gc.collect()
    gc.disable()
    try:
        refs = []
        for _ in range(3):
            with kvcompress.compress(model, WINDOW_SMALL, max_cache_len=capacity) as cache:
                model(_ids(), cache=cache)
                model(_ids(length=1), cache=cache)
            refs.append(weakref.ref(cache))
            del cache
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


# ============================================================================= environment switches

ENV_CASES = [
    ("KVCOMPRESS_DISABLE_PLUGIN_AUTOLOAD", "maybe", "1, true, yes, on / 0, false, no, off (any case), or empty"),
    ("KVCOMPRESS_DISABLE_PLUGIN_AUTOLOAD", "2", "1, true, yes, on"),
    ("KVCOMPRESS_KERNELS", "fast", "one of 'auto', 'reference', 'triton'"),
    ("KVCOMPRESS_KERNELS", "REFERENCE", "one of 'auto', 'reference', 'triton'"),
    ("KVCOMPRESS_KIVI_CUDA", "yes", "one of '0', '1'"),
    ("KVCOMPRESS_BLOCK_PLUGINS", "window;kivi", "comma-separated entry point names"),
    ("KVCOMPRESS_BLOCK_PLUGINS", "no_such_plugin", "names of installed 'kvcompress' entry points: double_sparse, "
                                                   "expected_attention, keydiff, kivi, knorm, leank, lowrank, "
                                                   "paged_eviction, snapkv, tova, window"),
    ("KVCOMPRESS_KIVI_CONFIG", "{not json", "a JSON object"),
    ("KVCOMPRESS_LEANK_CONFIG", "[1, 2]", "a JSON object"),
    ("KVCOMPRESS_KIVI_CUDA_CONFIG", "7", "a JSON object"),
]


@pytest.mark.parametrize("name,value,allowed", ENV_CASES, ids=[f"{c[0]}={c[1]}" for c in ENV_CASES])
def test_environment_switch_with_an_unrecognised_value_is_refused(monkeypatch, model, name, value, allowed):
    from kvcompress.manager import get_plugin_manager

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        get_plugin_manager()
    assert err.value.path == name
    one_line(str(err.value), f"{name}: expected {allowed}", f"got {value!r}")
    if name != "KVCOMPRESS_BLOCK_PLUGINS":  # building a cache checks the switches too
        with pytest.raises(ConfigError, match=name):
            kvcompress.Cache(parse_stack({"compressors": []}), model)


def test_environment_switches_with_recognised_values_work(monkeypatch, plugin_site):
    from kvcompress import manager

    install, _ = plugin_site
    install("kvcompress-hostile-env", "envplugin", "kvc_hostile_env", _SPEC + "@hookimpl\n"
            "def kvcompress_register_compressors(register):\n"
            "    register(CompressorSpec(name='envplugin', axis='evict', config=Cfg, factory=Comp))\n")
    monkeypatch.setenv("KVCOMPRESS_DISABLE_PLUGIN_AUTOLOAD", "TRUE")  # any case
    monkeypatch.setenv("KVCOMPRESS_KERNELS", "reference")
    assert manager.get_plugin_manager().get_plugin("envplugin") is None
    monkeypatch.setenv("KVCOMPRESS_DISABLE_PLUGIN_AUTOLOAD", "off")
    monkeypatch.setenv("KVCOMPRESS_BLOCK_PLUGINS", "envplugin, leank")
    pm = manager.get_plugin_manager()
    assert pm.get_plugin("envplugin") is None and pm.get_plugin("leank") is None and pm.get_plugin("window")
    monkeypatch.delenv("KVCOMPRESS_BLOCK_PLUGINS")
    assert manager.get_plugin_manager().get_plugin("envplugin") is not None
    monkeypatch.setenv("KVCOMPRESS_NO_SUCH_SWITCH_20", "1")
    with pytest.warns(KVCompressWarning, match="KVCOMPRESS_NO_SUCH_SWITCH_20; known switches: "):
        manager.get_plugin_manager()
