"""A decode step replayed as one CUDA graph, without per-call guards or graph-tree bookkeeping.

``torch.compile(model.forward, mode="reduce-overhead")`` replays CUDA graphs too, but every call first
evaluates dynamo's guards, walks CUDA-graph-tree bookkeeping and re-collects a thousand graph inputs in
Python: 1.4-3 ms of host time per step on an H200 host (docs/results.md), while the GPU work of a
compressed 8B decode step is 6-9 ms.  :class:`GraphStep` is the pattern serving engines use instead
(vLLM, SGLang, FlashInfer's wrappers): run the step a few times, capture one call into a
``torch.cuda.CUDAGraph``, then every later call copies its tensor arguments into the captured
input buffers and replays the graph.  The host cost of a step is a few copies and one graph launch.

What it requires of ``fn`` (all true for a static kvcompress cache, whose decode step is branch-free on
the device with buffers at fixed addresses - :class:`kvcompress.Cache` with ``max_cache_len``):

* every call runs the same device program: the graph replays the captured call and never looks at
  Python state again (a step whose work depended on host-side state would be replayed wrongly);
* tensor arguments keep their shapes, dtypes and devices (they are copied into the captured buffers);
  every other argument (the cache, ``logits_to_keep``) is the same object or an equal value each call;
* no host synchronisation inside ``fn`` (``.item()``, ``bool(tensor)``): a compiled function
  (``torch.compile(..., fullgraph=True)`` without CUDA graphs) is the natural ``fn``.

The returned outputs are copies (``clone_outputs=True``) or the captured buffers themselves, which the
next call overwrites.  Off CUDA, or with ``enabled=False``, calls go straight to ``fn``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .errors import UnsupportedOperationError


class GraphStep:
    """``fn(**kwargs)`` replayed as one CUDA graph after ``warmup`` direct calls (see the module docstring).

    The first ``warmup`` calls run ``fn`` directly (they are real steps: compilation, kernel selection
    and lazy allocations happen there, outside any graph); the next call captures ``fn`` (on a side
    stream, into a private memory pool) and replays the capture; every later call only replays.  :attr:`replays` counts replayed calls.
    """

    def __init__(self, fn: Callable[..., Any], *, warmup: int = 3, clone_outputs: bool = True,
                 enabled: bool | None = None):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (a capture needs compiled kernels and lazy state), got {warmup}")
        self.fn = fn
        self.warmup = warmup
        self.clone_outputs = clone_outputs
        self.enabled = enabled
        self.calls = 0
        self.replays = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._static: dict[str, Any] | None = None  # the captured call's arguments
        self._out: Any = None  # the captured call's outputs (graph-owned buffers)

    # -- arguments ------------------------------------------------------------------------------
    def _device(self, kwargs: dict[str, Any]) -> torch.device | None:
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                return value.device
        return None

    def _bind(self, kwargs: dict[str, Any]) -> None:
        """Copy this call's tensors into the static buffers; check that everything else is unchanged."""
        static = self._static
        if static.keys() != kwargs.keys():
            raise UnsupportedOperationError(
                f"a CUDA-graph decode step was captured with arguments {sorted(static)}, called with "
                f"{sorted(kwargs)}; call it with the same arguments every step")
        for name, value in kwargs.items():
            held = static[name]
            if isinstance(held, torch.Tensor):
                if not isinstance(value, torch.Tensor) or value.shape != held.shape or value.dtype != held.dtype \
                        or value.device != held.device:
                    got = (f"{tuple(value.shape)} {value.dtype} on {value.device}" if isinstance(value, torch.Tensor)
                           else type(value).__name__)
                    raise UnsupportedOperationError(
                        f"a CUDA-graph decode step captured {name!r} as {tuple(held.shape)} {held.dtype} on "
                        f"{held.device}, got {got}; build a new step for other shapes (batch size, tokens per step)")
                if value.data_ptr() != held.data_ptr():
                    held.copy_(value)
            elif value is not held and not _equal(value, held):
                raise UnsupportedOperationError(
                    f"a CUDA-graph decode step replays the call it captured: argument {name!r} changed "
                    f"({type(held).__name__} -> {type(value).__name__}); a new cache or setting needs a new step")

    # -- the call -------------------------------------------------------------------------------
    def __call__(self, **kwargs: Any) -> Any:
        device = self._device(kwargs)
        on = self.enabled if self.enabled is not None else (device is not None and device.type == "cuda")
        if not on:
            self.calls += 1
            return self.fn(**kwargs)
        if self._static is None:  # every call runs on these buffers: warm-up calls trace what the graph captures
            self._static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        else:
            self._bind(kwargs)
        if self.graph is not None:
            self.graph.replay()
            self.calls += 1
            self.replays += 1
            return self._outputs()
        if self.calls < self.warmup:  # a real step, outside any graph
            self.calls += 1
            return self.fn(**self._static)
        # capture this call, then run the step by replaying the capture
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._out = self.fn(**self._static)
        except RuntimeError as exc:
            self._out = None
            raise UnsupportedOperationError(
                f"the decode step could not be captured as a CUDA graph ({str(exc).splitlines()[0][:200]}); "
                "pass a step without host synchronisation, e.g. torch.compile(model.forward, fullgraph=True) "
                "over a static cache (kvcompress.Cache(..., max_cache_len=N))") from exc
        self.graph = graph
        graph.replay()
        self.calls += 1
        self.replays += 1
        return self._outputs()

    def _outputs(self) -> Any:
        return _clone(self._out) if self.clone_outputs else self._out

    def reset(self) -> None:
        """Forget the capture (its memory is released); the next calls warm up and capture again."""
        self.graph = None
        self._static = None
        self._out = None
        self.calls = 0


def _clone(x: Any) -> Any:
    """Copies of the tensors in ``x`` (tensors, and dicts / lists / tuples of them: a model output)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):  # transformers' ModelOutput is an ordered dict of its set fields
        return type(x)(**{k: _clone(v) for k, v in x.items()})
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(_clone(v) for v in x)
    return x


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a meaningful equality are compared by identity
        return False


__all__ = ["GraphStep"]
