"""Plugin manager factory: discovery of compressors through entry points.

Nothing here runs at import.  :func:`get_plugin_manager` builds a fresh plugin manager each call;
:func:`get_registry` caches the registry of the default manager for the process
(``reset_registry()`` clears it).

Entry points are loaded one at a time, as pip treats broken entry points: one that fails to import,
breaks the hook specification (a wrong argument name, an unknown hook) or raises while registering is
named - distribution, entry point, error - in one warning and skipped; every other plugin, built-ins
included, keeps working, and a stack that names a compressor of the skipped plugin fails with that
message.  A compressor name registered by two plugins is used by neither (see
:meth:`kvcompress.registry.Registry.add_all`).

Environment switches (checked by :mod:`kvcompress.env`):

* ``KVCOMPRESS_BLOCK_PLUGINS=name1,name2`` - do not load these entry points (names must exist).
* ``KVCOMPRESS_DISABLE_PLUGIN_AUTOLOAD=1`` - load only the built-in compressors.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pluggy

from . import hookspecs
from .env import check_environment, flag
from .errors import ConfigError, KVCompressWarning, PluginError
from .hookspecs import PROJECT
from .registry import PluginFailure, Registry

ENTRY_POINT_GROUP = "kvcompress"
BUILTIN_DIST = "kvcompress"

_REGISTRY: Registry | None = None


class PluginManager(pluggy.PluginManager):
    """pluggy's manager plus where each plugin came from and the entry points that were skipped."""

    def __init__(self) -> None:
        super().__init__(PROJECT)
        self.sources: dict[int, str] = {}  # id(plugin module) -> "built-in" / "<dist> <version>"
        self.entry_points: dict[int, str] = {}  # id(plugin module) -> "name = value"
        self.failures: list[PluginFailure] = []


def _blocked() -> set[str]:
    raw = os.environ.get("KVCOMPRESS_BLOCK_PLUGINS", "")
    return {name.strip() for name in raw.split(",") if name.strip()}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def get_plugin_manager() -> PluginManager:
    """A new plugin manager with every installed ``kvcompress`` entry point that loads cleanly."""
    check_environment()
    pm = PluginManager()
    pm.add_hookspecs(hookspecs.RegistrationSpec)
    blocked = _blocked()
    for name in blocked:
        pm.set_blocked(name)
    builtins_only = flag("KVCOMPRESS_DISABLE_PLUGIN_AUTOLOAD")
    declared = _load_entrypoints(pm, builtins_only)
    unknown = sorted(blocked - declared)
    if unknown:
        raise ConfigError("KVCOMPRESS_BLOCK_PLUGINS", f"names of installed '{ENTRY_POINT_GROUP}' entry points: "
                          f"{', '.join(sorted(declared))}", os.environ.get("KVCOMPRESS_BLOCK_PLUGINS"),
                          hint=f"unknown: {', '.join(unknown)}")
    if not pm.get_plugins():
        broken = "; ".join(f.message() for f in pm.failures)
        raise PluginError(
            "no compressor plugins were found: kvcompress must be installed (pip install -e .) "
            "so that its 'kvcompress' entry points exist" + (f" ({broken})" if broken else ""))
    pm.check_pending()  # every plugin with an unknown hook was skipped above
    return pm


def _load_entrypoints(pm: PluginManager, builtins_only: bool) -> set[str]:
    """Register every entry point of the group that loads cleanly; return the names declared (all of them)."""
    from importlib import metadata

    declared: dict[str, str] = {}
    for dist in metadata.distributions():
        dist_name = dist.metadata["name"] or "an unnamed distribution"
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP:
                continue
            source = "built-in" if dist_name == BUILTIN_DIST else f"{dist_name} {dist.version}"
            spelled = f"{ep.name} = {ep.value}"
            if ep.name in declared:  # a second copy of one distribution (e.g. an editable install) is fine
                if declared[ep.name] != ep.value:
                    pm.failures.append(PluginFailure(spelled, source, f"entry point name {ep.name!r} is also "
                                                     f"declared as '{declared[ep.name]}'", (ep.name,)))
                continue
            declared[ep.name] = ep.value
            if pm.is_blocked(ep.name) or (builtins_only and dist_name != BUILTIN_DIST):
                continue
            problem = _register(pm, ep)
            if problem is not None:
                pm.failures.append(PluginFailure(spelled, source, problem, (ep.name,)))
                continue
            plugin = pm.get_plugin(ep.name)
            pm.sources[id(plugin)] = source
            pm.entry_points[id(plugin)] = spelled
    return set(declared)


def _register(pm: PluginManager, ep: Any) -> str | None:
    """Load and register one entry point; what went wrong, or None."""
    try:
        plugin = ep.load()
    except Exception as exc:  # any import-time failure of a third-party module: skip it, say why
        return f"import failed: {_error(exc)}"
    try:
        pm.register(plugin, name=ep.name)
    except (ValueError, pluggy.PluginValidationError) as exc:
        return f"breaks the hook specification: {_error(exc)}"
    unknown = sorted({caller.name for caller in pm.get_hookcallers(plugin) or [] if not caller.has_spec()
                      for impl in caller.get_hookimpls() if impl.plugin is plugin and not impl.optionalhook})
    if unknown:
        pm.unregister(plugin)
        return f"implements unknown hook(s) {', '.join(unknown)} (known: kvcompress_register_compressors)"
    return None


def plugin_sources(pm: pluggy.PluginManager) -> dict[int, str]:
    """id(plugin module) -> "built-in" or "<distribution> <version>"."""
    return dict(getattr(pm, "sources", {}))


def build_registry(pm: PluginManager) -> Registry:
    """The compressors every plugin registers; a plugin whose registration raises is skipped (recorded)."""
    registry = Registry()
    registry.failures.extend(getattr(pm, "failures", []))
    impls = pm.hook.kvcompress_register_compressors.get_hookimpls()
    for impl in sorted(impls, key=lambda im: pm.sources.get(id(im.plugin)) != "built-in"):  # built-ins first
        source = pm.sources.get(id(impl.plugin), pm.get_name(impl.plugin) or "unknown")
        spelled = pm.entry_points.get(id(impl.plugin), pm.get_name(impl.plugin) or "unknown")
        specs: list[Any] = []
        kwargs = {"register": specs.append}
        try:
            impl.function(*[kwargs[name] for name in impl.argnames])
        except Exception as exc:  # a plugin's bug must not take the other plugins down
            name = pm.get_name(impl.plugin)
            registry.failures.append(PluginFailure(spelled, source, f"kvcompress_register_compressors raised "
                                                   f"{_error(exc)}", (name,) if name else ()))
            continue
        registry.add_all(specs, source, spelled)
    return registry


def get_registry() -> Registry:
    """The process-wide registry (built lazily on first use); each skipped plugin is named in one warning."""
    global _REGISTRY
    if _REGISTRY is None:
        registry = build_registry(get_plugin_manager())
        for failure in registry.failures:
            warnings.warn(failure.message(), KVCompressWarning, stacklevel=2)
        _REGISTRY = registry
    return _REGISTRY


def reset_registry() -> None:
    """Forget the cached registry (after installing a plugin, or in tests)."""
    global _REGISTRY
    _REGISTRY = None
