"""Compressor registry: name -> :class:`CompressorSpec`.

Filled by the ``kvcompress_register_compressors`` hook of every plugin module the
plugin manager loaded (built-ins included: they come through the same
``kvcompress`` entry-point group).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .errors import PluginError

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
        if self.axis not in AXES:
            raise PluginError(
                f"compressor {self.name!r} declares axis {self.axis!r}; allowed axes: {', '.join(AXES)}"
            )
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise PluginError(f"compressor name {self.name!r} must be a non-empty identifier")


class Registry:
    """Mapping of registered compressor names to specs."""

    def __init__(self) -> None:
        self._specs: dict[str, CompressorSpec] = {}

    def add(self, spec: CompressorSpec, source: str) -> None:
        if not isinstance(spec, CompressorSpec):
            raise PluginError(f"register() expects a CompressorSpec, got {type(spec).__name__} from {source}")
        if spec.name in self._specs:
            other = self._specs[spec.name].source
            raise PluginError(f"compressor {spec.name!r} registered twice: by {other} and by {source}")
        self._specs[spec.name] = dataclasses.replace(spec, source=source)

    def get(self, name: str) -> CompressorSpec | None:
        return self._specs.get(name)

    def names(self) -> list[str]:
        return sorted(self._specs)

    def __iter__(self):
        return iter(self._specs[n] for n in self.names())

    def __len__(self) -> int:
        return len(self._specs)
