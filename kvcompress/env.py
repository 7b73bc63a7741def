"""Environment switches: every ``KVCOMPRESS_*`` variable kvcompress reads, with the values it accepts.

:func:`check_environment` runs whenever plugins are loaded and whenever a cache is built; a switch set
to a value outside its allowed set is refused with a :class:`~kvcompress.errors.ConfigError` naming the
variable, the allowed values and the value (a typo such as ``KVCOMPRESS_KERNELS=refernce`` would
otherwise be ignored in silence).  A ``KVCOMPRESS_*`` variable kvcompress does not know is named in
one warning.  ``KVCOMPRESS_CACHE`` (a folder) is checked where it is used
(:func:`kvcompress.models.cache_root`); ``KVCOMPRESS_BLOCK_PLUGINS`` names are checked against the
installed entry points by :mod:`kvcompress.manager`.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Callable, Mapping

from .errors import ConfigError, KVCompressWarning

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
FLAG_ALLOWED = "1, true, yes, on / 0, false, no, off (any case), or empty"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _flag(value: str) -> str | None:
    return None if value.strip().lower() in _TRUE + _FALSE else FLAG_ALLOWED


def _choice(*allowed: str) -> Callable[[str], str | None]:
    return lambda value: None if value in allowed else "one of " + ", ".join(repr(a) for a in allowed)


def _names(value: str) -> str | None:
    names = [n.strip() for n in value.split(",") if n.strip()]
    ok = all(_NAME.fullmatch(n) for n in names)
    return None if ok else "comma-separated entry point names (letters, digits, '_', '-', '.')"


def _json_object(value: str) -> str | None:
    try:
        ok = isinstance(json.loads(value), dict)
    except ValueError:
        ok = False
    return None if ok else 'a JSON object, e.g. {"num_warps": 4}'


def _any(value: str) -> str | None:
    return None


#: variable -> check (returns None, or the allowed values when the value is refused)
SWITCHES: dict[str, Callable[[str], str | None]] = {
    "KVCOMPRESS_DISABLE_PLUGIN_AUTOLOAD": _flag,
    "KVCOMPRESS_BLOCK_PLUGINS": _names,
    "KVCOMPRESS_KERNELS": _choice("auto", "reference", "triton"),
    "KVCOMPRESS_KIVI_CUDA": _choice("0", "1"),
    "KVCOMPRESS_CACHE": _any,
    "KVCOMPRESS_KIVI_CONFIG": _json_object,
    "KVCOMPRESS_KIVI_CUDA_CONFIG": _json_object,
    "KVCOMPRESS_LEANK_CONFIG": _json_object,
    "KVCOMPRESS_PAGED_CONFIG": _json_object,
    "KVCOMPRESS_DS_CONFIG": _json_object,
}

_WARNED: set[str] = set()


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Value of a yes/no switch (refused unless it is one of :data:`FLAG_ALLOWED`)."""
    value = (os.environ if environ is None else environ).get(name, "")
    allowed = _flag(value)
    if allowed is not None:
        raise ConfigError(name, allowed, value, hint="an environment variable")
    return value.strip().lower() in _TRUE


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a known switch with an unrecognised value; warn once about unknown ``KVCOMPRESS_*`` names."""
    environ = os.environ if environ is None else environ
    for name, check in SWITCHES.items():
        value = environ.get(name)
        if value is not None:
            allowed = check(value)
            if allowed is not None:
                raise ConfigError(name, allowed, value, hint="an environment variable")
    unknown = sorted(n for n in environ if n.startswith("KVCOMPRESS_") and n not in SWITCHES and n not in _WARNED)
    if unknown:
        _WARNED.update(unknown)
        warnings.warn(f"kvcompress does not read the environment variable(s) {', '.join(unknown)}; known switches: "
                      f"{', '.join(SWITCHES)}", KVCompressWarning, stacklevel=2)
