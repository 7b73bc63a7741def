"""The quality tasks: ``ppl``, ``passkey`` and ``agreement``, each against the uncompressed model.

Every task runs the real compressed cache (``kvcompress.compress(model, stack)``): a prefill,
then **one decode step at a time**, so every scored or generated token is predicted by a decode
step that reads the compressed cache (prefill attention itself is exact in kvcompress).  The
baseline is plain transformers (the model's own ``DynamicCache``, no kvcompress code involved)
on the same tokens, computed once per (task, context, samples, tokens, seed) and reused by every
stack an :class:`Evaluator` runs.

* ``ppl``: ``samples`` windows of the document at evenly spread offsets.  Each prefills
  ``context`` tokens, then feeds the next ``tokens`` tokens one step at a time (teacher forcing);
  the logits of step *t* score token *t + 1*.  Reports perplexity, relative Δppl, mean
  KL(baseline‖stack) over scored positions and top-1 agreement with the baseline.
* ``passkey``: ``samples`` prompts (see :mod:`~kvcompress.evaluation.data`) with the needle at
  evenly spread depths.  ``question="after"`` (default): the haystack is prefilled (and compressed), the
  question is fed one token at a time - the query-agnostic setting, as kvpress compresses a context before
  its question; ``question="prefill"``: every prompt token but the last is prefilled, question included,
  the last is a decode step - the standard passkey prompt, and SnapKV's own setting (its observation window
  sees the question).  Then ``tokens`` tokens are decoded greedily.  Correct iff the first number
  generated is the key.
* ``agreement``: ``samples`` document windows of ``context`` tokens as prompts; all but the last
  prompt token are prefilled, the last is a decode step, then ``tokens`` tokens are decoded
  greedily (no stop at end-of-sequence).  ``agreement`` = fraction of generated positions whose
  token equals the baseline's at the same position (over all prompts); ``prefix`` = mean length
  of the common prefix as a fraction of ``tokens`` (stricter: nothing after the first difference).

With ``Evaluator(compile=True)`` (``kvcompress eval --compile``) each sample of a stack runs in a
static cache sized to the sample (``compress(model, stack, max_cache_len=N)``) and every decode step
goes through one ``torch.compile(model.forward, **graph_compile_options(device))`` shared by the samples,
on CUDA replayed as one CUDA graph per sample by :class:`kvcompress.graphs.GraphStep` (prefill stays eager);
the baseline stays plain eager transformers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from ..errors import ConfigError
from . import data, metrics
from .report import Progress, environment

TASKS = ("ppl", "passkey", "agreement")

#: Per task: default context, samples and tokens (scored / generated tokens per sample).
DEFAULTS = {
    "ppl": {"context": 2048, "samples": 1, "tokens": 256},
    "passkey": {"context": 4096, "samples": 5, "tokens": 8},
    "agreement": {"context": 1024, "samples": 4, "tokens": 64},
}

#: The headline metric of each task (plotted by sweeps) and whether higher is better.
HEADLINE = {"ppl": ("ppl", False), "passkey": ("accuracy", True), "agreement": ("agreement", True)}

MIN_CONTEXT = 16
MAX_CONTEXT = 1 << 17
MAX_SAMPLES = 10_000
MAX_TOKENS = 1 << 16
#: passkey: where the question goes (module doc)
QUESTION = ("after", "prefill")
SCHEMA = "kvcompress.eval/1"
_TOKEN_WORD = {"ppl": "scored", "passkey": "generated", "agreement": "generated"}


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What to run: the task and its sizes (validated by :func:`check_settings`)."""

    task: str
    context: int
    samples: int
    tokens: int
    seed: int = 0
    question: str = "after"  #: passkey only: "after" the compressed prefill or inside it ("prefill")

    @classmethod
    def for_task(cls, task: str, context: int | None = None, samples: int | None = None,
                 tokens: int | None = None, seed: int = 0, question: str | None = None) -> "EvalSettings":
        """Settings with the task's defaults for every size left as ``None``; validated."""
        check_settings(task, context, samples, tokens)
        if question is not None and task != "passkey":
            raise ConfigError("--question", "given only with --task passkey", question)
        if question is not None and question not in QUESTION:
            raise ConfigError("--question", "one of " + ", ".join(QUESTION), question)
        d = DEFAULTS[task]
        return cls(task, d["context"] if context is None else context, d["samples"] if samples is None else samples,
                   d["tokens"] if tokens is None else tokens, seed, question or "after")


def check_settings(task: Any, context: Any = None, samples: Any = None, tokens: Any = None) -> None:
    """Validate task and sizes before any model is loaded; ``ConfigError`` names the CLI option."""
    if task not in TASKS:
        raise ConfigError("--task", "one of " + ", ".join(TASKS), task,
                          hint="the option is required" if task is None else None)
    for option, value, lo, hi in (("--context", context, MIN_CONTEXT, MAX_CONTEXT),
                                  ("--samples", samples, 1, MAX_SAMPLES),
                                  ("--tokens", tokens, 1, MAX_TOKENS)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(option, f"an integer in [{lo}, {hi}] (tokens)" if option != "--samples"
                              else f"an integer in [{lo}, {hi}]", value)


@dataclasses.dataclass
class EvalResult:
    """One stack on one task, with the baseline's metrics; :meth:`to_dict` is the JSON object."""

    settings: EvalSettings
    stack: dict[str, Any]
    stack_label: str
    stack_source: str
    model: str
    dtype: str
    metrics: dict[str, float]
    baseline: dict[str, float]
    cache_bytes: int
    dense_bytes: int
    baseline_cache_bytes: int
    wall_s: float
    baseline_wall_s: float
    baseline_reused: bool
    details: list[dict[str, Any]]
    notes: list[str]
    env: dict[str, Any]
    compile: dict[str, Any] | None = None  #: torch.compile options of the stack's decode step (None: eager)
    #: bytes held after the last decode step and the most held after any step (largest over samples);
    #: ``cache_bytes`` is the end of prefill. ``None`` in results written before these were recorded.
    end_cache_bytes: int | None = None
    peak_cache_bytes: int | None = None
    baseline_end_cache_bytes: int | None = None
    baseline_peak_cache_bytes: int | None = None

    @property
    def compression(self) -> float:
        return self.dense_bytes / self.cache_bytes if self.cache_bytes else float("inf")

    @property
    def baseline_compression(self) -> float:
        return self.dense_bytes / self.baseline_cache_bytes if self.baseline_cache_bytes else float("inf")

    def settings_line(self) -> str:
        s = self.settings
        return (f"task {s.task} | {self.model} {self.dtype} | context {s.context} | "
                f"{s.samples} sample(s) x {s.tokens} {_TOKEN_WORD[s.task]} tokens"
                + (f" | question {'in the prefill' if s.question == 'prefill' else 'after the prefill'}"
                   if s.task == "passkey" else ""))

    def title(self) -> str:
        compiled = f" | compiled decode step ({_describe_compile(self.compile)})" if self.compile else ""
        return f"stack {self.stack_label} ({self.stack_source}) | " + self.settings_line() + compiled

    def table(self, markdown: bool = False) -> str:
        """Human-readable table: the stack against the uncompressed baseline (or as Markdown)."""
        from .report import format_table, markdown_table, mib

        m, b = self.metrics, self.baseline
        rows: list[tuple[str, str, str]] = [("metric", self.stack_label, "uncompressed")]
        if self.settings.task == "ppl":
            rows += [("perplexity", f"{m['ppl']:.4f}", f"{b['ppl']:.4f}"),
                     ("relative delta ppl", f"{m['delta_ppl']:+.2%}", ""),
                     ("mean KL(baseline||stack), nats", f"{m['kl']:.5f}", "0"),
                     ("top-1 agreement", f"{m['top1']:.2%}", "100%")]
        elif self.settings.task == "passkey":
            rows += [("passkey accuracy", f"{m['accuracy']:.0%}", f"{b['accuracy']:.0%}")]
            for d in self.details:
                rows.append((f"  depth {d['depth']:.2f} (key {d['key']})",
                             f"{'ok' if d['correct'] else 'FAIL'} {d['answer'].strip()!r}",
                             f"{'ok' if d['baseline_correct'] else 'FAIL'} {d['baseline_answer'].strip()!r}"))
        else:
            rows += [("token agreement (position-wise)", f"{m['agreement']:.2%}", "100%"),
                     ("common prefix / tokens", f"{m['prefix']:.2%}", "100%")]
        rows += [("cache bytes at end of prefill", f"{self.cache_bytes:,}", f"{self.baseline_cache_bytes:,}"),
                 ("  MiB", mib(self.cache_bytes), mib(self.baseline_cache_bytes))]
        if self.end_cache_bytes is not None:
            rows += [("cache MiB at end of decoding", mib(self.end_cache_bytes), mib(self.baseline_end_cache_bytes or 0)),
                     ("cache MiB, peak over the run", mib(self.peak_cache_bytes or 0),
                      mib(self.baseline_peak_cache_bytes or 0))]
        rows += [
                 ("compression (dense fp16 / held)", f"{self.compression:.2f}x", f"{self.baseline_compression:.2f}x"),
                 ("wall time", f"{self.wall_s:.1f} s",
                  f"{self.baseline_wall_s:.1f} s" + (" (reused)" if self.baseline_reused else ""))]
        text = self.title() + "\n" + (markdown_table(rows) if markdown else format_table(rows, "lrr"))
        for note in self.notes:
            text += f"\nnote: {note}"
        return text

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "schema": SCHEMA,
            "task": s.task,
            "stack": self.stack,
            "stack_label": self.stack_label,
            "stack_source": self.stack_source,
            "model": self.model,
            "dtype": self.dtype,
            "context": s.context,
            "samples": s.samples,
            "tokens": s.tokens,
            "seed": s.seed,
            "question": s.question,
            "metrics": self.metrics,
            "baseline": self.baseline,
            "cache_bytes": self.cache_bytes,
            "dense_bytes": self.dense_bytes,
            "compression": self.compression,
            "baseline_cache_bytes": self.baseline_cache_bytes,
            "baseline_compression": self.baseline_compression,
            "wall_s": self.wall_s,
            "baseline_wall_s": self.baseline_wall_s,
            "baseline_reused": self.baseline_reused,
            "details": self.details,
            "notes": self.notes,
            "compile": self.compile,
            "end_cache_bytes": self.end_cache_bytes,
            "peak_cache_bytes": self.peak_cache_bytes,
            "baseline_end_cache_bytes": self.baseline_end_cache_bytes,
            "baseline_peak_cache_bytes": self.baseline_peak_cache_bytes,
            "environment": self.env,
        }


    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "EvalResult":
        """Inverse of :meth:`to_dict` (e.g. to re-plot a sweep from its JSON file)."""
        settings = EvalSettings(obj["task"], obj["context"], obj["samples"], obj["tokens"], obj.get("seed", 0),
                                obj.get("question", "after"))
        return cls(settings, obj["stack"], obj["stack_label"], obj["stack_source"], obj["model"], obj["dtype"],
                   obj["metrics"], obj["baseline"], obj["cache_bytes"], obj["dense_bytes"],
                   obj["baseline_cache_bytes"], obj["wall_s"], obj["baseline_wall_s"], obj["baseline_reused"],
                   obj["details"], obj["notes"], obj["environment"], obj.get("compile"),
                   obj.get("end_cache_bytes"), obj.get("peak_cache_bytes"), obj.get("baseline_end_cache_bytes"),
                   obj.get("baseline_peak_cache_bytes"))


# --------------------------------------------------------------------------------------- sessions


class DecodeSession:
    """One sequence through one cache: plain transformers (``stack=None``) or a kvcompress stack.

    ``forward(ids)`` runs the model on the next tokens and returns the last position's
    logits (float32, on the CPU; ``fetch=False`` returns None and leaves the device alone).

    With ``capacity`` the cache is static: transformers' ``StaticCache`` (``stack=None``) or the
    stack's static kvcompress cache (``max_cache_len=capacity``); positions are passed explicitly.
    With ``step`` (a compiled ``model.forward``, see :func:`compiled_step`) every single-token call
    goes through it; multi-token calls (prefill) run eagerly.
    """

    def __init__(self, model: Any, stack: Any, capacity: int | None = None, step: Callable[..., Any] | None = None):
        from ..adapters import hf

        if step is not None and capacity is None:
            raise ValueError("a compiled decode step needs a static cache (capacity)")
        self.model, self.stack, self.hf = model, stack, hf
        self.kw = hf.cache_kwarg(model)
        self.device = next(model.parameters()).device
        self.cache: Any = None
        self.capacity, self.step = capacity, step
        self.position = 0  #: tokens fed so far
        self._scope = contextlib.ExitStack()
        params = inspect.signature(model.forward).parameters
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._cache_position = "cache_position" in params  # transformers 5.17; gone in 5.24

    def __enter__(self) -> "DecodeSession":
        if self.capacity is not None:
            self.cache = self._scope.enter_context(static_cache(self.model, self.stack, self.capacity))
        elif self.stack is not None:
            from ..api import compress

            self.cache = self._scope.enter_context(compress(self.model, self.stack))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scope.close()

    def forward(self, ids: Sequence[int], fetch: bool = True) -> torch.Tensor | None:
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        n = x.shape[1]
        with torch.no_grad():
            if self.capacity is not None:
                if self.position + n > self.capacity:
                    raise ValueError(f"static cache of {self.capacity} tokens: cannot feed {n} more after "
                                     f"{self.position}")
                kw = positions(self.model, self.position, n, 1, self.device, self._cache_position)
                if self.step is not None and n == 1:
                    mark_step(self.device)
                    out = self.step(input_ids=x, **{self.kw: self.cache}, **kw, **self._extra)
                else:
                    out = self.model(input_ids=x, **{self.kw: self.cache}, **kw, **self._extra)
            elif self.cache is None:  # plain transformers: the model creates its own DynamicCache
                out = self.model(x, use_cache=True, **self._extra)
                self.cache = self.hf.output_cache(out)
            else:
                out = self.model(x, **{self.kw: self.cache}, **self._extra)
        self.position += n
        return out.logits[0, -1].float().cpu() if fetch else None

    def memory(self) -> tuple[int, int]:
        """(bytes held by the cache, fp16 bytes of the dense cache of the same tokens)."""
        return cache_memory(self.cache)


# --------------------------------------------------------------------------------------- compiled decode


def _describe_compile(options: dict[str, Any] | None) -> str:
    if not options:
        return "eager"
    return ", ".join(f"{k}={v}" for k, v in options.items())


def compile_options(device: Any) -> dict[str, Any]:
    """``torch.compile`` options of a compiled decode step on ``device``.

    CUDA: ``mode="reduce-overhead", fullgraph=True`` (Inductor kernels replayed as CUDA graphs:
    what makes decoding fast).  Elsewhere (CPU): ``backend="aot_eager", fullgraph=True``: the step
    is traced into one graph (a graph break is an error) and run by eager kernels, so numbers equal
    the eager path's; this checks that the step compiles, it does not make it faster.
    """
    if torch.device(device).type == "cuda":
        return {"mode": "reduce-overhead", "fullgraph": True}
    return {"backend": "aot_eager", "fullgraph": True}


def compiled_step(model: Any) -> Callable[..., Any]:
    """``torch.compile(model.forward, **compile_options(model's device))``."""
    return torch.compile(model.forward, **compile_options(next(model.parameters()).device))


def graph_compile_options(device: Any) -> dict[str, Any]:
    """``torch.compile`` options of a step that :class:`kvcompress.graphs.GraphStep` captures itself: Inductor
    without CUDA-graph trees on CUDA (``fullgraph=True``), ``aot_eager`` elsewhere (no graph is captured)."""
    if torch.device(device).type == "cuda":
        return {"fullgraph": True}
    return {"backend": "aot_eager", "fullgraph": True}


def graph_step(model: Any, warmup: int = 2) -> Callable[..., Any]:
    """The decode step replayed as one CUDA graph captured by kvcompress (:class:`kvcompress.graphs.GraphStep`)
    over ``torch.compile(model.forward, **graph_compile_options(device))``; a static cache is required."""
    from ..graphs import GraphStep

    return GraphStep(torch.compile(model.forward, **graph_compile_options(next(model.parameters()).device)),
                     warmup=warmup)


def eval_compile_options(device: Any) -> dict[str, Any]:
    """How ``eval --compile`` runs a decode step (reported with its results): :func:`graph_compile_options`,
    replayed as one CUDA graph by :class:`kvcompress.graphs.GraphStep` on CUDA."""
    options = dict(graph_compile_options(device))
    if torch.device(device).type == "cuda":
        options["cuda_graph"] = "kvcompress GraphStep"
    return options


def generate_compile_config(device: Any) -> Any:
    """transformers' ``CompileConfig`` for ``model.generate(..., compile_config=...)`` with the options of
    :func:`compile_options` (``fullgraph=True``: a graph break is an error, not a silently slow step).

    transformers compiles the decode step itself when the cache is compileable; off CUDA only when
    the config allows every device (``_compile_all_devices``), which this one does.
    """
    from ..adapters import hf

    return hf.compile_config(compile_options(device))


def mark_step(device: Any) -> None:
    """Tell CUDA-graph trees that a new decode step begins (outputs of the previous one are dead)."""
    if torch.device(device).type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()


def positions(model: Any, start: int, n: int, batch: int, device: Any, cache_position: bool | None = None
              ) -> dict[str, torch.Tensor]:
    """``position_ids`` (``[batch, n]``) and, on transformers versions that take it, ``cache_position``
    for tokens ``start .. start + n - 1``: a static cache cannot infer them without a host read."""
    if cache_position is None:
        cache_position = "cache_position" in inspect.signature(model.forward).parameters
    pos = torch.arange(start, start + n, device=device)
    kw = {"position_ids": pos.unsqueeze(0).repeat(batch, 1)}
    if cache_position:
        kw["cache_position"] = pos
    return kw


def static_supported() -> bool:
    """Whether this kvcompress has the static-capacity cache (``compress(..., max_cache_len=N)``)."""
    from ..api import compress

    return "max_cache_len" in inspect.signature(compress).parameters


def check_compile_supported() -> None:
    """Raise a clear error when ``--compile`` cannot work (no static kvcompress cache)."""
    if not static_supported():
        from ..errors import UnsupportedOperationError

        raise UnsupportedOperationError("--compile needs kvcompress' static-capacity cache "
                                        "(kvcompress.compress(model, stack, max_cache_len=N)), which this "
                                        "kvcompress does not have")


@contextlib.contextmanager
def static_cache(model: Any, stack: Any, capacity: int, batch: int | None = None) -> Iterator[Any]:
    """A static cache of ``capacity`` tokens: transformers' ``StaticCache`` for ``stack=None``, else the
    stack's static kvcompress cache with kvcompress attention attached (``compress(max_cache_len=...)``)."""
    if stack is None:
        from ..adapters import hf

        yield hf.cache_utils.StaticCache(config=model.config, max_cache_len=capacity)
        return
    from ..api import compress

    check_compile_supported()
    kw = {"max_batch_size": batch} if batch is not None else {}
    with compress(model, stack, max_cache_len=capacity, **kw) as cache:
        yield cache


def cache_memory(cache: Any) -> tuple[int, int]:
    """(bytes held, fp16 bytes of the dense cache of the same tokens) of a kvcompress ``Cache``
    (its memory report) or of a plain transformers cache (its layers' key and value tensors)."""
    if hasattr(cache, "memory_report"):
        report = cache.memory_report()
        return report.cache_bytes, report.dense_fp16_bytes
    held = dense = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                held += t.numel() * t.element_size()
                dense += t.numel() * 2
    return held, dense


@dataclasses.dataclass
class _Run:
    """Raw outputs of one cache (baseline or stack) on every sample of a task."""

    samples: list[dict[str, Any]]
    cache_bytes: int
    dense_bytes: int
    wall_s: float
    end_bytes: int = 0  #: bytes held after the last step (largest over samples)
    peak_bytes: int = 0  #: most bytes held after any step (largest over samples)


# --------------------------------------------------------------------------------------- evaluator


class Evaluator:
    """Runs tasks for one loaded model; caches the uncompressed baseline per settings.

    Args:
        model, tokenizer: a transformers causal LM and its tokenizer (any dtype / device).
        model_name: the name recorded in results.
        progress: show progress bars on stderr.
    """

    def __init__(self, model: Any, tokenizer: Any, model_name: str = "model", progress: bool = True,
                 compile: bool = False):
        self.model, self.tokenizer, self.model_name = model, tokenizer, model_name
        self.progress = progress
        self.compile = compile  #: stacks run in a static cache with a compiled decode step
        if compile:
            check_compile_supported()
        self.device = next(model.parameters()).device
        self.dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        self._baselines: dict[EvalSettings, _Run] = {}
        self.baseline_runs = 0  #: how many baselines were computed (a sweep computes one)

    # -- public ---------------------------------------------------------------------------
    def run(self, stack: Any, settings: EvalSettings) -> EvalResult:
        """Run ``stack`` (a :class:`~kvcompress.Stack`, path, mapping or None) on ``settings``' task."""
        from ..stack import as_stack

        stack = as_stack(stack)
        notes = self.check(settings)
        reused = settings in self._baselines
        base = self.baseline(settings)
        run = self._execute(stack, settings, stack.label, compiled=self.compile)
        metric, base_metric, details = getattr(self, f"_score_{settings.task}")(run, base)
        if settings.task == "passkey":
            notes += self._passkey_notes(base_metric["accuracy"], settings)
        return EvalResult(
            settings=settings, stack=stack.to_dict(), stack_label=stack.label, stack_source=stack.source,
            model=self.model_name, dtype=self.dtype, metrics=metric, baseline=base_metric,
            cache_bytes=run.cache_bytes, dense_bytes=run.dense_bytes, baseline_cache_bytes=base.cache_bytes,
            wall_s=run.wall_s, baseline_wall_s=base.wall_s, baseline_reused=reused, details=details,
            notes=notes, env=environment(self.device),
            compile=eval_compile_options(self.device) if self.compile else None,
            end_cache_bytes=run.end_bytes, peak_cache_bytes=run.peak_bytes,
            baseline_end_cache_bytes=base.end_bytes, baseline_peak_cache_bytes=base.peak_bytes)

    def baseline(self, settings: EvalSettings) -> _Run:
        """The uncompressed run (plain transformers) for ``settings``, computed once."""
        if settings not in self._baselines:
            self._baselines[settings] = self._execute(None, settings, "uncompressed (transformers)")
            self.baseline_runs += 1
        return self._baselines[settings]

    def check(self, settings: EvalSettings) -> list[str]:
        """Checks that need the tokenizer or model; returns notes for the output."""
        notes = []
        doc = len(data.document_tokens(self.tokenizer))
        if settings.task == "ppl" and settings.context + settings.tokens + 1 > doc:
            raise ConfigError("--context", f"context + tokens + 1 <= {doc} (tokens in the document text)",
                              settings.context, hint=f"--tokens is {settings.tokens}")
        if settings.task == "agreement" and settings.context > doc:
            raise ConfigError("--context", f"at most {doc} (tokens in the document text)", settings.context)
        if settings.task == "passkey":
            low = data.min_passkey_context(self.tokenizer)
            if settings.context < low:
                raise ConfigError("--context", f"at least {low} tokens for a passkey prompt", settings.context)
        trained = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        # a compiled run's static cache holds a sample's prompt and decoded tokens (ppl: its scored span too), and
        # a kvcompress cache is never larger than the model's positions
        ppl = settings.task == "ppl"
        if self.compile and trained and settings.context + settings.tokens * (1 + ppl) + ppl > trained:
            raise ConfigError("--context", f"with --compile, context + tokens{' x 2 + 1' if ppl else ''} within the "
                              f"model's {trained} positions (the static cache's capacity)", settings.context,
                              hint=f"--tokens is {settings.tokens}")
        if trained and settings.context + settings.tokens > trained:
            notes.append(f"context + tokens ({settings.context + settings.tokens}) exceeds the model's "
                         f"{trained} trained positions")
        return notes

    # -- execution --------------------------------------------------------------------------
    def _execute(self, stack: Any, settings: EvalSettings, desc: str, compiled: bool = False) -> _Run:
        """Every sample of the task through ``stack`` (None: plain transformers).

        ``compiled``: each sample runs in a static cache sized to the sample (prompt + decoded
        tokens) and every decode step through one compiled ``model.forward`` shared by the samples
        (compiled state left from earlier runs in this process is reset first).
        """
        task = settings.task
        if task == "ppl":
            doc = data.document_tokens(self.tokenizer)
            span = settings.context + settings.tokens + 1
            jobs = [doc[o:o + span] for o in data.spread_offsets(len(doc), span, settings.samples)]
            steps = settings.tokens
        elif task == "passkey":
            jobs = data.passkey_samples(self.tokenizer, settings.context, settings.samples, settings.seed)
            steps = len(jobs[0].question) + settings.tokens - 1
        else:
            doc = data.document_tokens(self.tokenizer)
            jobs = [doc[o:o + settings.context]
                    for o in data.spread_offsets(len(doc), settings.context, settings.samples)]
            steps = settings.tokens
        fn = None
        if compiled:  # one compiled step shared by the samples; each sample's cache gets its own CUDA graph
            from ..graphs import GraphStep

            torch.compiler.reset()
            fn = torch.compile(self.model.forward, **graph_compile_options(self.device))
        bar = Progress(len(jobs) * (1 + steps), f"{task} {desc}", enabled=self.progress)
        held = dense = end = peak = 0
        outputs = []
        start = time.perf_counter()
        with bar:
            for job in jobs:
                ids = job.ids if task == "passkey" else job
                capacity = len(ids) + settings.tokens if compiled else None
                step = GraphStep(fn, warmup=2) if fn is not None else None
                with DecodeSession(self.model, stack, capacity=capacity, step=step) as session:
                    if task == "ppl":
                        out = self._ppl_sample(session, job, settings, bar.update)
                    elif task == "passkey":
                        prefill = job.question_start if settings.question == "after" else len(job.ids) - 1
                        out = self._generate(session, job.ids, prefill, settings.tokens, bar.update)
                        out.update(key=job.key, depth=job.depth, needle_token=job.needle_start,
                                   prompt_tokens=len(job.ids))
                    else:
                        out = self._generate(session, job, len(job) - 1, settings.tokens, bar.update)
                held, dense = max(held, out.pop("cache_bytes")), max(dense, out.pop("dense_bytes"))
                end, peak = max(end, out.pop("end_bytes")), max(peak, out.pop("peak_bytes"))
                outputs.append(out)
        return _Run(outputs, held, dense, time.perf_counter() - start, end, peak)

    @staticmethod
    def _ppl_sample(session: DecodeSession, ids: Sequence[int], settings: EvalSettings,
                    tick: Callable[[], None]) -> dict[str, Any]:
        n, m = settings.context, settings.tokens
        session.forward(ids[:n])
        tick()
        held, dense = session.memory()
        peak = held
        logits = []
        for t in range(n, n + m):
            logits.append(session.forward(ids[t:t + 1]))
            peak = max(peak, session.memory()[0])
            tick()
        logits = torch.stack(logits)
        targets = torch.tensor(ids[n + 1:n + m + 1])
        return {"logits": logits, "nll": metrics.token_nll(logits, targets), "cache_bytes": held,
                "dense_bytes": dense, "end_bytes": session.memory()[0], "peak_bytes": peak}

    @staticmethod
    def _generate(session: DecodeSession, ids: Sequence[int], prefill: int, new: int,
                  tick: Callable[[], None]) -> dict[str, Any]:
        """Prefill ``ids[:prefill]``, feed the rest one token at a time, then decode ``new`` tokens greedily."""
        session.forward(ids[:prefill])
        tick()
        held, dense = session.memory()
        peak = held
        logits = None
        for t in range(prefill, len(ids)):
            logits = session.forward(ids[t:t + 1])
            peak = max(peak, session.memory()[0])
            tick()
        generated: list[int] = []
        while True:
            token = int(logits.argmax())
            generated.append(token)
            if len(generated) == new:
                break
            logits = session.forward([token])
            peak = max(peak, session.memory()[0])
            tick()
        return {"generated": generated, "cache_bytes": held, "dense_bytes": dense, "end_bytes": session.memory()[0],
                "peak_bytes": peak}

    # -- scoring ----------------------------------------------------------------------------
    def _score_ppl(self, run: _Run, base: _Run):
        # Per sample (bounded memory: the float64 softmaxes of one sample at a time), then pooled.
        kls, same, details = [], 0, []
        for s, b in zip(run.samples, base.samples):
            kl = metrics.kl_divergence(b["logits"], s["logits"])
            top1 = metrics.top1_agreement(b["logits"], s["logits"])
            kls.append(kl)
            same += round(top1 * kl.numel())
            details.append({"ppl": metrics.perplexity(s["nll"]), "baseline_ppl": metrics.perplexity(b["nll"]),
                            "kl": kl.mean().item(), "top1": top1})
        kl = torch.cat(kls)
        nll = torch.cat([s["nll"] for s in run.samples])
        base_nll = torch.cat([s["nll"] for s in base.samples])
        ppl, base_ppl = metrics.perplexity(nll), metrics.perplexity(base_nll)
        result = {"ppl": ppl, "delta_ppl": metrics.relative_change(ppl, base_ppl), "kl": kl.mean().item(),
                  "kl_max": kl.max().item(), "top1": same / kl.numel(), "scored_tokens": int(nll.numel())}
        base_result = {"ppl": base_ppl, "delta_ppl": 0.0, "kl": 0.0, "kl_max": 0.0, "top1": 1.0,
                       "scored_tokens": int(base_nll.numel())}
        return result, base_result, details

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def _score_passkey(self, run: _Run, base: _Run):
        details = []
        for s, b in zip(run.samples, base.samples):
            text, base_text = self._decode(s["generated"]), self._decode(b["generated"])
            details.append({"depth": s["depth"], "key": s["key"], "needle_token": s["needle_token"],
                            "prompt_tokens": s["prompt_tokens"], "answer": text,
                            "correct": metrics.passkey_correct(text, s["key"]), "baseline_answer": base_text,
                            "baseline_correct": metrics.passkey_correct(base_text, s["key"])})
        acc = sum(d["correct"] for d in details) / len(details)
        base_acc = sum(d["baseline_correct"] for d in details) / len(details)
        return {"accuracy": acc}, {"accuracy": base_acc}, details

    def _score_agreement(self, run: _Run, base: _Run):
        details = []
        for s, b in zip(run.samples, base.samples):
            details.append({"agreement": metrics.token_agreement(b["generated"], s["generated"]),
                            "prefix": metrics.prefix_agreement(b["generated"], s["generated"]),
                            "text": self._decode(s["generated"]), "baseline_text": self._decode(b["generated"])})
        n = len(details)
        result = {"agreement": sum(d["agreement"] for d in details) / n,
                  "prefix": sum(d["prefix"] for d in details) / n}
        return result, {"agreement": 1.0, "prefix": 1.0}, details

    @staticmethod
    def _passkey_notes(base_acc: float, settings: EvalSettings) -> list[str]:
        if base_acc == 1.0:
            return []
        if base_acc == 0.0:
            return [f"the uncompressed baseline itself fails every sample at context {settings.context}: "
                    "the task is beyond the model here, so this result says nothing about the stack"]
        return [f"the uncompressed baseline itself fails {1 - base_acc:.0%} of the samples at context "
                f"{settings.context}; compare the stack with the baseline, not with 100%"]
