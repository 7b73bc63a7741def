"""Attention over a layer's segments (sinks, middle store, recent window, new tokens)."""

from .reference import segment_attention

__all__ = ["segment_attention"]
