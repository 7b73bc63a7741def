"""Model-level decode benchmark: per-step latency, memory and the framework's own overhead.

For plain transformers (the model's own ``DynamicCache``) and each stack, a round prefills
``context`` tokens of the document text (not timed), then times ``steps`` teacher-forced
decode steps one by one.  Rounds are interleaved across caches (round 1 of every cache, then
round 2, ...) after an untimed warm-up round, so slow drifts of the machine hit all alike.

* **Latency**: each step is timed alone; on the CPU with ``time.perf_counter`` (CPU ops are
  synchronous), on CUDA with CUDA events around the step (synchronised once per round).
  Reported: median, 10th and 90th percentile over all timed steps.
* **Memory**: the bytes the cache holds after the last step (every tensor, from
  ``Cache.memory_report()``; for plain transformers the keys and values) against the dense fp16
  cache of the same tokens.  On CUDA also ``torch.cuda.max_memory_allocated`` during the round
  minus what was allocated before it (weights excluded).  On the CPU there is no allocator peak
  to read (tracemalloc does not see torch's allocations), so only cache bytes are reported.
* **Overhead**: one extra, instrumented round per stack wraps methods of that round's cache
  objects only (instance attributes, removed afterwards; nothing global or class-level is
  patched): each compressed layer's ``attend`` (kvcompress' whole attention for the layer),
  the dense attention function ``attend`` receives (the SDPA math), the layer's ``commit``
  (storing the new token, flushing the ring) and the pipeline's ``flush`` (compressor hooks:
  score, evict, transforms, store) and ``select`` (read-time selection).  Per decode step,
  summed over layers: ``overhead = attend - SDPA``, everything kvcompress does besides the
  attention math.  On CUDA the instrumented round synchronises around each wrapped call, so
  its numbers are upper bounds; the latency table comes from the uninstrumented rounds.
* **Compiled rows** (``compile=True``, ``kvcompress bench --compile``): transformers' ``StaticCache``
  and each stack's static cache with the decode step compiled (``runner.compile_options``); each
  runs its warm-up round (compilation) and rounds back to back, not instrumented.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from .report import Progress, environment, format_table, markdown_table, mib
from .runner import DecodeSession

BREAKDOWN_KEYS = ("attend", "sdpa", "read", "commit", "flush", "select", "overhead")

#: Untimed decode steps at the start of every round of a compiled row (a fresh static cache has new
#: buffer addresses, so CUDA-graph trees re-record on its first steps).
COMPILED_UNTIMED = 2


@dataclasses.dataclass
class BenchRow:
    label: str
    source: str | None
    stack: dict[str, Any] | None
    step_ms: list[float]
    cache_bytes: int
    dense_bytes: int
    peak_bytes: int | None
    breakdown: dict[str, float] | None = None
    instrumented_step_ms: float | None = None
    compiled: bool = False  #: static cache + compiled decode step
    warmup_s: float | None = None  #: compiled rows: wall time of the warm-up round (compilation included)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    def quantile_ms(self, q: float) -> float:
        xs = sorted(self.step_ms)
        return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "source": self.source, "stack": self.stack, "median_ms": self.median_ms,
                "p10_ms": self.quantile_ms(0.1), "p90_ms": self.quantile_ms(0.9), "step_ms": self.step_ms,
                "cache_bytes": self.cache_bytes, "dense_bytes": self.dense_bytes,
                "compression": self.dense_bytes / self.cache_bytes if self.cache_bytes else None,
                "peak_bytes": self.peak_bytes, "overhead_ms_per_step": self.breakdown,
                "instrumented_step_ms": self.instrumented_step_ms, "compiled": self.compiled,
                "warmup_s": self.warmup_s}


@dataclasses.dataclass
class BenchResult:
    model: str
    dtype: str
    device: str
    context: int
    steps: int
    rounds: int
    rows: list[BenchRow]
    env: dict[str, Any]
    wall_s: float
    compile: dict[str, Any] | None = None  #: torch.compile options of the compiled rows (None: none ran)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "kvcompress.bench/1", "model": self.model, "dtype": self.dtype, "device": self.device,
                "context": self.context, "steps": self.steps, "rounds": self.rounds,
                "rows": [r.to_dict() for r in self.rows], "wall_s": self.wall_s, "compile": self.compile,
                "environment": self.env}

    def latency_rows(self) -> list[list[str]]:
        base = self.rows[0].median_ms
        rows = [["cache", "ms/step (median)", "p10-p90", "vs plain", "cache MiB", "compression", "peak MiB"]]
        for r in self.rows:
            rows.append([r.label, f"{r.median_ms:.2f}", f"{r.quantile_ms(0.1):.2f}-{r.quantile_ms(0.9):.2f}",
                         f"{r.median_ms / base:.2f}x", mib(r.cache_bytes),
                         f"{r.dense_bytes / r.cache_bytes:.2f}x" if r.cache_bytes else "-", mib(r.peak_bytes)])
        return rows

    def overhead_rows(self) -> list[list[str]]:
        rows = [["stack", "step (instr.)", "attend", "SDPA", "read", "commit", "flush", "select", "overhead",
                 "overhead share"]]
        for r in self.rows:
            if r.breakdown is None:
                continue
            b = r.breakdown
            rows.append([r.label, f"{r.instrumented_step_ms:.2f}",
                         *[f"{b[k]:.2f}" for k in ("attend", "sdpa", "read", "commit", "flush", "select",
                                                   "overhead")],
                         f"{b['overhead'] / r.instrumented_step_ms:.1%}"])
        return rows

    def table(self, markdown: bool = False) -> str:
        fmt = markdown_table if markdown else format_table
        head = (f"decode step latency: {self.model} {self.dtype} on {self.device}, context {self.context}, "
                f"{self.steps} teacher-forced steps x {self.rounds} rounds")
        if self.compile:
            head += (f"; '+ compile' rows: static cache, decode step torch.compile("
                     f"{', '.join(f'{k}={v!r}' for k, v in self.compile.items())}), "
                     f"{COMPILED_UNTIMED} untimed steps per round")
        text = head + "\n" + fmt(self.latency_rows())
        over = self.overhead_rows()
        if len(over) > 1:
            text += ("\n\nkvcompress' own work per decode step (ms, summed over layers; one instrumented round): "
                     "overhead = attend - SDPA\n" + fmt(over))
        return text


class _Probe:
    """Times methods of one cache's own objects by wrapping them as instance attributes."""

    def __init__(self, cache: Any, sync: Callable[[], None]):
        self.cache, self.sync = cache, sync
        self.totals = dict.fromkeys(("attend", "sdpa", "commit", "flush", "select"), 0.0)
        self._installed: list[tuple[Any, str]] = []

    def _timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        totals, sync = self.totals, self.sync

        def timed(*args: Any, **kwargs: Any) -> Any:
            sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync()
                totals[key] += time.perf_counter() - t0

        return timed

    def _timed_attend(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        inner = self._timed(fn, "attend")

        def attend(*args: Any, **kwargs: Any) -> Any:
            if "dense_attention" in kwargs:
                kwargs["dense_attention"] = self._timed(kwargs["dense_attention"], "sdpa")
            elif len(args) >= 4 and callable(args[3]):
                args = (*args[:3], self._timed(args[3], "sdpa"), *args[4:])
            return inner(*args, **kwargs)

        return attend

    def _set(self, obj: Any, name: str, wrapper: Callable[..., Any]) -> None:
        if name in vars(obj):
            raise RuntimeError(f"{type(obj).__name__}.{name} is already an instance attribute")
        setattr(obj, name, wrapper)
        self._installed.append((obj, name))

    def install(self) -> None:
        pipelines = {}
        for layer in self.cache.compressed_layers:
            self._set(layer, "attend", self._timed_attend(layer.attend))
            self._set(layer, "commit", self._timed(layer.commit, "commit"))
            pipe = getattr(layer, "pipeline", None)
            if pipe is not None:
                pipelines[id(pipe)] = pipe
        for pipe in pipelines.values():
            for name in ("flush", "select"):
                if callable(getattr(pipe, name, None)):
                    self._set(pipe, name, self._timed(getattr(pipe, name), name))

    def remove(self) -> None:
        for obj, name in reversed(self._installed):
            vars(obj).pop(name, None)
        self._installed.clear()

    def per_step_ms(self, steps: int) -> dict[str, float]:
        t = {k: v * 1e3 / steps for k, v in self.totals.items()}
        t["read"] = t["attend"] - t["sdpa"] - t["commit"] - t["select"]
        t["commit"] -= t["flush"]  # store / ring work only; the pipeline's share is `flush`
        t["overhead"] = t["attend"] - t["sdpa"]
        return {k: t[k] for k in BREAKDOWN_KEYS}


def _device_of(model: Any) -> torch.device:
    return next(model.parameters()).device


def decode_round(model: Any, stack: Any, tokens: Sequence[int], context: int, steps: int, probe: bool = False,
                 step: Callable[..., Any] | None = None, untimed: int = 0
                 ) -> tuple[list[float], int, int, int | None, dict[str, float] | None, float]:
    """One round for one cache: prefill ``tokens[:context]`` (untimed), then ``steps`` timed decode steps.

    ``stack=None`` is plain transformers.  With ``probe=True`` (and a stack) the steps run
    instrumented (see the module docstring) and the breakdown is returned.  With ``step`` (a
    compiled ``model.forward``) the cache is static (transformers' ``StaticCache`` for
    ``stack=None``), sized ``context + untimed + steps``, and decode steps run through ``step``;
    ``untimed`` decode steps run before the timed ones.

    Returns:
        (per-step ms, cache bytes, dense fp16 bytes, CUDA peak bytes or None, breakdown or None,
        wall ms per step of the round).
    """
    device = _device_of(model)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    peak = None
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    capacity = context + untimed + steps if step is not None else None
    with DecodeSession(model, stack, capacity=capacity, step=step) as session:
        session.forward(tokens[:context], fetch=False)
        for t in range(context, context + untimed):
            session.forward(tokens[t:t + 1], fetch=False)
        context += untimed
        probe_obj = None
        if probe and stack is not None:
            probe_obj = _Probe(session.cache, sync)
            probe_obj.install()
        times: list[float] = []
        events = []
        sync()
        wall0 = time.perf_counter()
        try:
            for t in range(context, context + steps):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    session.forward(tokens[t:t + 1], fetch=False)
                    end.record()
                    events.append((start, end))
                else:
                    t0 = time.perf_counter()
                    session.forward(tokens[t:t + 1], fetch=False)
                    times.append((time.perf_counter() - t0) * 1e3)
            sync()
        finally:
            if probe_obj is not None:
                probe_obj.remove()
        wall = (time.perf_counter() - wall0) * 1e3 / steps
        if cuda:
            times = [a.elapsed_time(b) for a, b in events]
            peak = torch.cuda.max_memory_allocated(device) - before
        held, dense = session.memory()
    breakdown = probe_obj.per_step_ms(steps) if probe_obj is not None else None
    return times, held, dense, peak, breakdown, wall


def bench_decode(model: Any, tokens: Sequence[int], stacks: Sequence[Any], *, context: int = 1024, steps: int = 32,
                 rounds: int = 3, warmup_steps: int = 2, model_name: str = "model", progress: bool = True,
                 compile: bool = False) -> BenchResult:
    """Decode latency, memory and overhead of plain transformers and each stack.

    Args:
        model: a transformers causal LM (on the device to measure).
        tokens: token ids, at least ``context + steps`` of them (``+ COMPILED_UNTIMED`` with ``compile``).
        stacks: :class:`~kvcompress.Stack` objects (or anything ``as_stack`` accepts).
        compile: also measure compiled rows: transformers' ``StaticCache`` and each stack's static
            cache, decode steps through ``torch.compile(model.forward, **compile_options(device))``.
            A compiled row runs its warm-up round (compilation) and its rounds back to back after
            ``torch.compiler.reset()``, each round after ``COMPILED_UNTIMED`` untimed steps; the eager
            rows are interleaved as without ``compile``.  Compiled rows are not instrumented.
    """
    from ..stack import as_stack
    from .runner import check_compile_supported, compile_options, compiled_step

    untimed = COMPILED_UNTIMED if compile else 0
    if len(tokens) < context + untimed + steps:
        raise ValueError(f"need {context + untimed + steps} tokens, got {len(tokens)}")
    if compile and stacks:
        check_compile_supported()
    # (label, source, stack, compiled)
    configs: list[tuple[str, str | None, Any, bool]] = [("transformers DynamicCache", None, None, False)]
    for s in stacks:
        st = as_stack(s)
        configs.append((st.label, st.source, st, False))
    if compile:
        configs.insert(1, ("transformers StaticCache + compile", None, None, True))
        configs += [(f"{label} + compile", source, st, True) for label, source, st, c in configs[2:] if not c]
    eager = [i for i, c in enumerate(configs) if not c[3]]
    compiled = [i for i, c in enumerate(configs) if c[3]]
    start = time.perf_counter()
    per_config: dict[int, list] = {i: [] for i in range(len(configs))}
    last: dict[int, tuple] = {}
    warmup_s: dict[int, float] = {}
    probed = [i for i in eager if configs[i][2] is not None]
    bar = Progress(len(configs) * (rounds + 1) + len(probed), "bench", enabled=progress)

    def timed_round(i: int, step: Callable[..., Any] | None = None) -> None:
        times, held, dense, peak, _, _ = decode_round(model, configs[i][2], tokens, context, steps, step=step,
                                                      untimed=untimed if step is not None else 0)
        per_config[i].extend(times)
        prev_peak = last.get(i, (0, 0, None))[2]
        last[i] = (held, dense, peak if prev_peak is None else max(prev_peak, peak or 0))
        bar.update()

    with torch.no_grad(), bar:
        for i in eager:  # warm-up
            decode_round(model, configs[i][2], tokens, context, max(1, warmup_steps))
            bar.update()
        for _ in range(rounds):
            for i in eager:
                timed_round(i)
        breakdowns: dict[int, tuple[dict[str, float], float]] = {}
        for i in probed:
            _, _, _, _, breakdown, wall = decode_round(model, configs[i][2], tokens, context, steps, probe=True)
            breakdowns[i] = (breakdown, wall)
            bar.update()
        for i in compiled:
            torch.compiler.reset()
            step = compiled_step(model)
            t0 = time.perf_counter()
            decode_round(model, configs[i][2], tokens, context, max(1, warmup_steps), step=step, untimed=untimed)
            warmup_s[i] = time.perf_counter() - t0
            bar.update()
            for _ in range(rounds):
                timed_round(i, step)
            del step
            torch.compiler.reset()
    rows = []
    for i, (label, source, st, is_compiled) in enumerate(configs):
        held, dense, peak = last[i]
        b = breakdowns.get(i)
        rows.append(BenchRow(label, source, st.to_dict() if st is not None else None, per_config[i], held, dense,
                             peak, b[0] if b else None, b[1] if b else None, is_compiled, warmup_s.get(i)))
    device = _device_of(model)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return BenchResult(model_name, dtype, str(device), context, steps, rounds, rows, environment(device),
                       time.perf_counter() - start, compile_options(device) if compile else None)


def run_kernel_benchmarks(device: str, out: str | None) -> tuple[bool, Any]:
    """Call ``kvcompress.kernels.benchutil.run_kernel_benchmarks`` when that module exists.

    Returns ``(available, result or reason)``.
    """
    import importlib

    try:
        module = importlib.import_module("kvcompress.kernels.benchutil")
    except ModuleNotFoundError as exc:
        if exc.name in ("kvcompress.kernels.benchutil", "kvcompress.kernels"):
            return False, "kernel benchmarks are not available: kvcompress.kernels.benchutil does not exist yet"
        return False, f"kernel benchmarks are not available: importing them failed ({exc})"
    except ImportError as exc:
        return False, f"kernel benchmarks are not available: importing them failed ({exc})"
    fn = getattr(module, "run_kernel_benchmarks", None)
    if fn is None:
        return False, "kernel benchmarks are not available: kvcompress.kernels.benchutil has no run_kernel_benchmarks"
    return True, fn(device=device, out=out)
