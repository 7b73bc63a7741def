"""Plugin manager factory: discovery of compressors through entry points.

Nothing here runs at import.  :func:`get_plugin_manager` builds a fresh
:class:`pluggy.PluginManager` each call; :func:`get_registry` caches the
registry of the default manager for the process (``reset_registry()`` clears it).

Environment switches:

* ``KVCOMPRESS_BLOCK_PLUGINS=name1,name2`` - do not load these entry points.
* ``KVCOMPRESS_DISABLE_PLUGIN_AUTOLOAD=1`` - load only the built-in compressors.
"""

from __future__ import annotations

import os

import pluggy

from . import hookspecs
from .errors import PluginError
from .hookspecs import PROJECT
from .registry import Registry

ENTRY_POINT_GROUP = "kvcompress"
BUILTIN_DIST = "kvcompress"

_REGISTRY: Registry | None = None


def _blocked() -> set[str]:
    raw = os.environ.get("KVCOMPRESS_BLOCK_PLUGINS", "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def get_plugin_manager() -> pluggy.PluginManager:
    """A new plugin manager with every installed ``kvcompress`` entry point loaded."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs.RegistrationSpec)
    for name in _blocked():
        pm.set_blocked(name)
    autoload = os.environ.get("KVCOMPRESS_DISABLE_PLUGIN_AUTOLOAD", "") not in ("1", "true", "yes")
    try:
        if autoload:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        else:
            _load_builtin_entrypoints(pm)
    except Exception as exc:  # a broken third-party plugin must not be silently skipped
        raise PluginError(f"failed to load a '{ENTRY_POINT_GROUP}' entry point: {exc}") from exc
    if not pm.get_plugins():
        raise PluginError(
            "no compressor plugins were found: kvcompress must be installed (pip install -e .) "
            "so that its 'kvcompress' entry points exist"
        )
    pm.check_pending()
    return pm


def _load_builtin_entrypoints(pm: pluggy.PluginManager) -> None:
    from importlib import metadata

    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.dist is not None and ep.dist.name == BUILTIN_DIST and not pm.is_blocked(ep.name):
            pm.register(ep.load(), name=ep.name)


def plugin_sources(pm: pluggy.PluginManager) -> dict[int, str]:
    """id(plugin module) -> "built-in" or "<distribution> <version>"."""
    sources: dict[int, str] = {}
    for plugin, dist in pm.list_plugin_distinfo():
        name = dist.metadata["name"]
        sources[id(plugin)] = "built-in" if name == BUILTIN_DIST else f"{name} {dist.version}"
    return sources


def build_registry(pm: pluggy.PluginManager) -> Registry:
    registry = Registry()
    sources = plugin_sources(pm)
    for impl in pm.hook.kvcompress_register_compressors.get_hookimpls():
        source = sources.get(id(impl.plugin), pm.get_name(impl.plugin) or "unknown")
        impl.function(register=lambda spec, _s=source: registry.add(spec, _s))
    return registry


def get_registry() -> Registry:
    """The process-wide registry (built lazily on first use)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = build_registry(get_plugin_manager())
    return _REGISTRY


def reset_registry() -> None:
    """Forget the cached registry (after installing a plugin, or in tests)."""
    global _REGISTRY
    _REGISTRY = None
