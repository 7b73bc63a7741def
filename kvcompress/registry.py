"""Compressor registry: name -> :class:`CompressorSpec`.

Filled by the ``kvcompress_register_compressors`` hook of every plugin module the
plugin manager loaded (built-ins included: they come through the same
``kvcompress`` entry-point group).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .errors import PluginError, shorten

#: Pipeline axes, in the order a stack must list them.  Axes sharing a rank are
#: alternatives at the same stage.
AXES: dict[str, int] = {
    "evict": 1,
    "select": 1,
    "prune": 2,
    "lowrank": 2,
    "regroup": 3,
    "quantize": 4,
}

#: Axes on which at most one compressor of a stack may act.  Pruning and
#: low-rank both rewrite the key channels, so they share one group.
EXCLUSIVE_GROUPS: dict[str, str] = {
    "evict": "token eviction",
    "select": "read-time selection",
    "prune": "key channels (prune / low-rank)",
    "lowrank": "key channels (prune / low-rank)",
    "regroup": "head regrouping",
    "quantize": "quantization",
}

PIPELINE_ORDER = "score -> evict -> prune / low-rank -> regroup -> quantize"


@dataclasses.dataclass(frozen=True)
class CompressorSpec:
    """What a plugin registers for one compressor.

    Attributes:
        name: the key users write in YAML (``- window: {...}``).
        axis: one of :data:`AXES`; fixes the compressor's place in the pipeline.
        config: frozen dataclass built with :func:`kvcompress.config.param`.
        factory: ``factory(config) -> compressor object`` implementing hooks of
            :class:`kvcompress.hookspecs.CacheCompressor`.
        summary: one line shown by ``kvcompress plugins``.
        source: filled by the registry: ``"built-in"`` or the distribution name.
    """

    name: str
    axis: str
    config: type
    factory: Callable[[Any], Any]
    summary: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or self.axis not in AXES:
            raise PluginError(
                f"compressor {self.name!r} declares axis {self.axis!r}; allowed axes: {', '.join(AXES)}"
            )
        if not isinstance(self.name, str) or not self.name.replace("_", "").replace("-", "").isalnum():
            raise PluginError(f"compressor name {self.name!r} must be a non-empty identifier")


@dataclasses.dataclass(frozen=True)
class PluginFailure:
    """A plugin entry point that was skipped: it failed to import, broke the hook specification, raised
    while registering, or registered a compressor name another plugin registers too.

    Attributes:
        entry_point: ``"name = module"`` as declared by the distribution.
        source: ``"built-in"`` or ``"<distribution> <version>"``.
        error: what went wrong (exception type and message, one line).
        names: compressor names the failure makes unavailable (the entry point's name, and the names
            involved in a collision).
    """

    entry_point: str
    source: str
    error: str
    names: tuple[str, ...] = ()

    def message(self) -> str:
        return shorten(f"plugin entry point '{self.entry_point}' of {self.source} was skipped: {self.error}")


class Registry:
    """Mapping of registered compressor names to specs, plus the plugins that could not be used."""

    def __init__(self) -> None:
        self._specs: dict[str, CompressorSpec] = {}
        self.failures: list[PluginFailure] = []
        self._claimants: dict[str, list[str]] = {}  # compressor name -> sources of a collision

    def add(self, spec: CompressorSpec, source: str) -> None:
        if not isinstance(spec, CompressorSpec):
            raise PluginError(f"register() expects a CompressorSpec, got {type(spec).__name__} from {source}")
        if spec.name in self._specs:
            other = self._specs[spec.name].source
            raise PluginError(f"compressor {spec.name!r} registered twice: by {other} and by {source}")
        self._specs[spec.name] = dataclasses.replace(spec, source=source)

    def add_all(self, specs: list[Any], source: str, entry_point: str) -> None:
        """Add what one plugin registered.  A name registered by two plugins is used by neither (the name is
        refused with the collision as its reason; both plugins' other compressors stay usable)."""
        for spec in specs:
            if not isinstance(spec, CompressorSpec):
                self.failures.append(PluginFailure(entry_point, source, f"register() expects a CompressorSpec, "
                                                   f"got {type(spec).__name__}", (entry_point.split(" = ")[0],)))
                continue
            other = self._specs.pop(spec.name, None)
            if other is None and spec.name not in self._claimants:
                self._specs[spec.name] = dataclasses.replace(spec, source=source)
                continue
            claimants = self._claimants.setdefault(spec.name, [other.source] if other is not None else [])
            claimants.append(source)
            self.failures.append(PluginFailure(entry_point, source, self.conflicts[spec.name], (spec.name,)))

    @property
    def conflicts(self) -> dict[str, str]:
        """Compressor name -> why it is unavailable (registered by several plugins)."""
        return {name: f"compressor {name!r} is registered by {' and by '.join(sources)}; neither is used "
                      "(uninstall one, or skip one with KVCOMPRESS_BLOCK_PLUGINS=<entry point>)"
                for name, sources in self._claimants.items()}

    def why_missing(self, name: Any) -> str | None:
        """Why compressor ``name`` is not available, when a skipped plugin explains it (else None)."""
        if name in self.conflicts:
            return self.conflicts[name]
        for failure in self.failures:
            if name in failure.names:
                return failure.message()
        if self.failures:
            return (f"unknown compressor; {len(self.failures)} plugin entry point(s) were skipped: "
                    + "; ".join(f.entry_point for f in self.failures[:5]) + " (`kvcompress plugins` lists them)")
        return None

    def get(self, name: str) -> CompressorSpec | None:
        return self._specs.get(name)

    def names(self) -> list[str]:
        return sorted(self._specs)

    def __iter__(self):
        return iter(self._specs[n] for n in self.names())

    def __len__(self) -> int:
        return len(self._specs)
