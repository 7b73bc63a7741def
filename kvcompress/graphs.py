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

**Planned steps.**  An argument with ``plan_step()`` and ``finish_step(completed)`` methods (a static
:class:`kvcompress.Cache`) is asked before every call which device program the step runs - for a
kvcompress cache, whether a block of tokens leaves the recent window in it - and told after the call whether
it ran.  ``fn`` branches on that plan in Python (a compiled ``fn`` gets one variant per plan), and the step
keeps one CUDA graph per plan key: each key's first ``warmup`` calls (``variant_warmup`` for keys after the
first) run directly, the next one is captured, later ones replay.  The graphs share one memory pool (they
never run at the same time).  So a KIVI step that flushes nothing (31 of 32) replays a graph without the flush
kernels.  :attr:`variants` lists the captured keys; :attr:`direct_calls` counts calls that ran ``fn`` directly.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .errors import UnsupportedOperationError


class GraphStep:
    """``fn(**kwargs)`` replayed as one CUDA graph after ``warmup`` direct calls (see the module docstring).

    The first ``warmup`` calls run ``fn`` directly (they are real steps: compilation, kernel selection
    and lazy allocations happen there, outside any graph); the next call captures ``fn`` (on a side
    stream, into a private memory pool) and replays the capture; every later call only replays.  Under a
    planning argument (module docstring) this holds per plan key, with ``variant_warmup`` direct calls for
    each key after the first (its compilation happens there).  :attr:`replays` counts replayed calls.
    """

    def __init__(self, fn: Callable[..., Any], *, warmup: int = 3, clone_outputs: bool = True,
                 enabled: bool | None = None, variant_warmup: int = 1):
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (a capture needs compiled kernels and lazy state), got {warmup}")
        if variant_warmup < 1:
            raise ValueError(f"variant_warmup must be >= 1 (a new variant compiles in a direct call), got "
                             f"{variant_warmup}")
        self.fn = fn
        self.warmup = warmup
        self.variant_warmup = variant_warmup
        self.clone_outputs = clone_outputs
        self.enabled = enabled
        self.calls = 0
        self.replays = 0
        self.direct_calls = 0
        self._captures: dict[Any, _Capture] = {}  # plan key -> its capture
        self._pool: Any = None  # the graphs' shared memory pool
        self._static: dict[str, Any] | None = None  # the captured calls' arguments (shared by every variant)

    @property
    def graph(self) -> "torch.cuda.CUDAGraph | None":
        """The first captured graph (``None`` before any capture)."""
        return next((c.graph for c in self._captures.values() if c.graph is not None), None)

    @property
    def variants(self) -> list[Any]:
        """Plan keys with a captured graph, in capture order."""
        return [key for key, c in self._captures.items() if c.graph is not None]

    # -- arguments ------------------------------------------------------------------------------
    def _device(self, kwargs: dict[str, Any]) -> torch.device | None:
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                return value.device
        return None

    def accepts(self, **kwargs: Any) -> bool:
        """Whether a call with ``kwargs`` can run on this step's captured arguments (always before the first call):
        the same names, tensors of the same shapes, dtypes and devices, every other argument unchanged."""
        return self._static is None or self._mismatch(kwargs) is None

    def _mismatch(self, kwargs: dict[str, Any]) -> str | None:
        """Why ``kwargs`` cannot be bound to the static buffers (``None``: they can)."""
        static = self._static
        if static.keys() != kwargs.keys():
            return (f"a CUDA-graph decode step was captured with arguments {sorted(static)}, called with "
                    f"{sorted(kwargs)}; call it with the same arguments every step")
        for name, value in kwargs.items():
            held = static[name]
            if isinstance(held, torch.Tensor):
                if not isinstance(value, torch.Tensor) or value.shape != held.shape or value.dtype != held.dtype \
                        or value.device != held.device:
                    got = (f"{tuple(value.shape)} {value.dtype} on {value.device}" if isinstance(value, torch.Tensor)
                           else type(value).__name__)
                    return (f"a CUDA-graph decode step captured {name!r} as {tuple(held.shape)} {held.dtype} on "
                            f"{held.device}, got {got}; build a new step for other shapes (batch size, tokens per step)")
            elif value is not held and not _equal(value, held):
                return (f"a CUDA-graph decode step replays the call it captured: argument {name!r} changed "
                        f"({type(held).__name__} -> {type(value).__name__}); a new cache or setting needs a new step")
        return None

    def _bind(self, kwargs: dict[str, Any]) -> None:
        """Copy this call's tensors into the static buffers; check that everything else is unchanged."""
        problem = self._mismatch(kwargs)
        if problem is not None:
            raise UnsupportedOperationError(problem)
        for name, value in kwargs.items():
            held = self._static[name]
            if isinstance(held, torch.Tensor) and value.data_ptr() != held.data_ptr():
                held.copy_(value)

    @staticmethod
    def _planners(kwargs: dict[str, Any]) -> list[Any]:
        return [v for v in kwargs.values() if not isinstance(v, torch.Tensor) and callable(getattr(v, "plan_step", None))
                and callable(getattr(v, "finish_step", None))]

    # -- the call -------------------------------------------------------------------------------
    def __call__(self, **kwargs: Any) -> Any:
        planners = self._planners(kwargs)
        key = tuple(p.plan_step() for p in planners) if planners else None
        completed = False
        try:
            out = self._run(key, kwargs)
            completed = True
        finally:
            for p in planners:
                p.finish_step(completed)
        return out

    def _run(self, key: Any, kwargs: dict[str, Any]) -> Any:
        device = self._device(kwargs)
        on = self.enabled if self.enabled is not None else (device is not None and device.type == "cuda")
        if not on:
            self.calls += 1
            self.direct_calls += 1
            return self.fn(**kwargs)
        if self._static is None:  # every call runs on these buffers: warm-up calls trace what the graph captures
            self._static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        else:
            self._bind(kwargs)
        capture = self._captures.get(key)
        if capture is None:
            capture = self._captures[key] = _Capture(self.warmup if not self._captures else self.variant_warmup)
        if capture.graph is not None:
            capture.graph.replay()
            self.calls += 1
            self.replays += 1
            return self._outputs(capture)
        if capture.calls < capture.warmup:  # a real step, outside any graph
            capture.calls += 1
            self.calls += 1
            self.direct_calls += 1
            return self.fn(**self._static)
        # capture this call, then run the step by replaying the capture
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                capture.out = self.fn(**self._static)
        except RuntimeError as exc:
            capture.out = None
            raise UnsupportedOperationError(
                f"the decode step could not be captured as a CUDA graph ({str(exc).splitlines()[0][:200]}); "
                "pass a step without host synchronisation, e.g. torch.compile(model.forward, fullgraph=True) "
                "over a static cache (kvcompress.Cache(..., max_cache_len=N))") from exc
        capture.graph = graph
        graph.replay()
        self.calls += 1
        self.replays += 1
        return self._outputs(capture)

    def _outputs(self, capture: "_Capture") -> Any:
        return _clone(capture.out) if self.clone_outputs else capture.out

    def reset(self) -> None:
        """Forget the captures (their memory is released); the next calls warm up and capture again."""
        self._captures = {}
        self._pool = None
        self._static = None
        self.calls = 0


class _Capture:
    """One plan key's state: direct calls so far, its graph and the graph's output buffers."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Any = None


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
