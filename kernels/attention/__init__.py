"""Attention over a layer's segments (sinks, middle store, recent window, new tokens).

``attend_segments`` is the read path (per-segment partials merged by log-sum-exp,
encoded segments read in place by their kernels); ``segment_attention`` is the
joint-softmax reference it is tested against.
"""

from .partials import attend_segments
from .reference import merge_partials, partial_attention, segment_attention

__all__ = ["attend_segments", "merge_partials", "partial_attention", "segment_attention"]
