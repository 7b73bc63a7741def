"""End-to-end decode benchmark at a real model shape with random weights (issue 16).

``kvcompress bench --model-shape llama3-8b --random-weights [--compile]`` and
``python benchmarks/e2e_decode.py`` (the same code) build a model of a named shape with random
weights directly on the device (no download), then, for every shape point ``B x ctx``
(``--points``, default ``1x32768,8x16384``) and every row:

========================================  ===============================================================
row                                       cache and decode step
========================================  ===============================================================
``transformers DynamicCache``             plain transformers, eager
``transformers StaticCache + compile``    ``StaticCache`` + ``torch.compile(model.forward, ...)``
``STACK``                                 kvcompress, dynamic cache (no capacity), eager
``STACK static``                          kvcompress static cache (``compress(..., max_cache_len=N)``),
                                          eager decode step
``STACK + compile``                       kvcompress static cache, compiled decode step
========================================  ===============================================================

prefills ``ctx`` random tokens per row (chunked: at most ``--prefill-tokens`` tokens per forward
call; not timed), runs ``--warmup`` untimed decode steps (compilation and CUDA-graph recording
happen here), times ``--steps`` decode steps one by one (synchronised before and after each:
wall ms per step, median), then runs ``--profile-steps`` more under ``torch.profiler`` (CUDA
activity): GPU-busy ms per step = the summed duration of the CUDA kernels / steps.  The static
caches are sized ``ctx + warmup + steps + profile_steps``.  Compiled rows use
``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`` on CUDA and
``backend="aot_eager", fullgraph=True`` on the CPU (a correctness check, not faster).

Every row runs in its own cache, which is dropped (with ``torch.compiler.reset()``) before the
next; an exception in a row is recorded in that row and the run goes on.  ``--json OUT`` is
rewritten after every row (``complete`` is false until the end), so an interrupted run keeps
what it measured.

Throughput mode (``--throughput --kv-gib G --ctx N``): for ``StaticCache + compile`` and each stack
compiled, the cache bytes of one and of two sequences after an ``N``-token prefill give the bytes
per sequence; the largest batch whose cache fits ``G`` GiB is prefilled (chunked) and decoded:
decode tokens/s = batch x steps / (wall time of ``steps`` back-to-back decode steps).  With
``--fill-rows K`` only K distinct prompts are prefilled and the cache's rows are then repeated to the
batch (``batch_repeat_interleave`` of a static cache; transformers' StaticCache rows are copied the same
way): a batch of ~100 rows x 32k tokens would otherwise spend most of a GPU session in prefill, and a
decode step's time does not depend on the values the rows hold.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import inspect
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import ConfigError
from .report import environment, format_table, markdown_table

SCHEMA = "kvcompress.e2e/1"

#: Named model shapes (Llama architecture).  ``llama3-8b`` is Meta-Llama-3-8B's geometry.
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                 tie_word_embeddings=False),
}

DEFAULT_POINTS = "1x32768,8x16384"

#: Stacks usable on any model (no calibration file of one model): the issue's benchmark set.
#: ``--stack builtin`` runs all of them.  ``lowrank32-random*`` get a random orthonormal key basis
#: written for the model at run time (speed only: a random basis says nothing about quality).
BUILTIN_STACKS: dict[str, dict[str, Any]] = {
    "none": {"compressors": []},
    "window-4+1020": {"compressors": [{"window": {"sinks": 4, "recent": 1020}}]},
    "kivi2": {"compressors": [{"kivi": {"bits": 2, "group": 32, "residual": 128}}]},
    "kivi4": {"compressors": [{"kivi": {"bits": 4, "group": 32, "residual": 128}}]},
    "leank-rope70": {"compressors": [{"leank": {"mask": "rope", "ratio": 0.7, "align": 16, "sinks": 128,
                                                "local": 768, "flush": 128}}]},
    "leank-rope70-kivi2": {"compressors": [{"leank": {"mask": "rope", "ratio": 0.7, "align": 16, "sinks": 128,
                                                      "local": 768, "flush": 128}},
                                           {"kivi": {"bits": 2, "group": 32, "residual": 128}}]},
    "paged-1024": {"compressors": [{"paged_eviction": {"budget": 1024, "block": 16, "score": "v_over_k"}}]},
    "paged-1024-kivi2": {"compressors": [{"paged_eviction": {"budget": 1024, "block": 32, "score": "v_over_k"}},
                                         {"kivi": {"bits": 2, "group": 32, "residual": 128}}]},
    "ds-shared-random-1024": {"compressors": [{"double_sparse": {"channels": "random", "r": 16, "k": 1024,
                                                                 "sinks": 4, "window": 64, "dense_layers": 2,
                                                                 "group_shared": True}}]},
    "lowrank32-random": {"compressors": [{"lowrank": {"basis": "<random>", "rank": 32, "sinks": 128,
                                                      "recent": 768, "flush": 128}}]},
    "lowrank32-random-kivi2": {"compressors": [{"lowrank": {"basis": "<random>", "rank": 32, "sinks": 32,
                                                            "recent": 128, "flush": 32}},
                                               {"kivi": {"bits": 2, "group": 32, "residual": 128, "sinks": 32}}]},
}

ROW_KINDS = ("dynamic", "static", "eager", "static-eager", "compiled", "graph")

_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "stacks"


# ----------------------------------------------------------------------------- inputs


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"1x32768,8x16384"`` -> ``[(1, 32768), (8, 16384)]`` (batch, context); ConfigError names ``--points``."""
    points = []
    for part in str(text).split(","):
        b, sep, c = part.strip().lower().partition("x")
        try:
            batch, ctx = int(b), int(c)
        except ValueError:
            batch = ctx = 0
        if not sep or not 1 <= batch <= 4096 or not 1 <= ctx <= (1 << 20):
            raise ConfigError("--points", "comma-separated BATCHxCONTEXT pairs, e.g. 1x32768,8x16384 "
                              "(batch in [1, 4096], context in [1, 1048576])", text)
        points.append((batch, ctx))
    return points


def check_stack_args(names: Sequence[str]) -> list[str]:
    """Expand ``builtin`` and check every name or file before any model is built; returns the names."""
    from ..stack import load_stack

    out: list[str] = []
    for name in names:
        if name == "builtin":
            out += list(BUILTIN_STACKS)
            continue
        if os.path.isfile(name):
            load_stack(name)  # validate now
        elif name not in BUILTIN_STACKS and not _example(name):
            raise ConfigError("--stack", "a YAML stack file, 'builtin', a built-in benchmark stack ("
                              + ", ".join(BUILTIN_STACKS) + ") or the name of a file in examples/stacks/", name)
        out.append(name)
    return out


def _example(name: str) -> Path | None:
    here = Path.cwd() / "examples" / "stacks"  # an installed package has no examples; a checkout's cwd may
    for folder in (_EXAMPLES, _EXAMPLES / "sweeps", here, here / "sweeps"):
        path = folder / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def resolve_stacks(names: Sequence[str], model: Any) -> list[Any]:
    """:class:`~kvcompress.Stack` objects for ``names`` (files, built-in benchmark stacks, example names)."""
    from ..stack import load_stack, parse_stack

    stacks = []
    for name in check_stack_args(names):
        if os.path.isfile(name):
            stacks.append(load_stack(name))
        elif name in BUILTIN_STACKS:
            spec = json.loads(json.dumps(BUILTIN_STACKS[name]))
            for entry in spec["compressors"]:
                cfg = entry.get("lowrank")
                if cfg is not None and cfg.get("basis") == "<random>":
                    cfg["basis"] = random_basis_file(model, rank=max(32, cfg.get("rank") or 32))
            stacks.append(parse_stack({"name": name, **spec}, source=f"builtin:{name}"))
        else:
            stacks.append(load_stack(str(_example(name))))
    return stacks


def random_basis_file(model: Any, rank: int = 32, seed: int = 0) -> str:
    """A low-rank key basis file of random orthonormal directions for ``model`` (in a temporary folder
    removed at exit): lets the ``lowrank`` compressor run on a random-weight model (speed only)."""
    from ..calibration.lowrank import save_basis
    from ..calibration.masks import config_hash, geometry

    layers, kv_heads, head_dim = geometry(model.config)
    rank = min(rank, head_dim)
    g = torch.Generator().manual_seed(seed)
    vectors, _ = torch.linalg.qr(torch.randn(layers, kv_heads, head_dim, head_dim, generator=g))
    eigenvalues = torch.linspace(1.0, 0.01, head_dim).expand(layers, kv_heads, head_dim).contiguous()
    ranks = torch.full((layers, kv_heads), rank, dtype=torch.int32)
    folder = tempfile.mkdtemp(prefix="kvcompress-e2e-")
    atexit.register(shutil.rmtree, folder, True)
    path = os.path.join(folder, f"random-basis-{rank}.safetensors")
    meta = {"model": "random", "model_config_hash": config_hash(model.config),
            "model_geometry": {"model_type": getattr(model.config, "model_type", "?"), "layers": layers,
                               "kv_heads": kv_heads, "head_dim": head_dim},
            "target": f"rank={rank}", "align": 1, "settings": {"random": True, "seed": seed}}
    save_basis(path, vectors, ranks, eigenvalues, meta)
    return path


# ----------------------------------------------------------------------------- model


def random_model(shape: str, device: Any = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 **overrides: Any) -> Any:
    """A Llama model of a named shape (:data:`SHAPES`, ``overrides`` replacing config fields) with random
    weights, built on ``device`` in ``dtype`` (transformers' own initialisation, run on the device)."""
    from ..adapters import hf

    if shape not in SHAPES:
        raise ConfigError("--model-shape", "one of " + ", ".join(SHAPES), shape)
    return hf.random_llama({**SHAPES[shape], **overrides}, f"random-{shape}", device, dtype, seed)


#: ``READY`` in a folder of random weights: rank 0 finished writing them (:func:`tp_random_model`)
READY = "kvcompress-random-weights.ready"


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def tp_random_model(shape: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0, folder: str | None = None,
                    **overrides: Any) -> Any:
    """Under a ``torchrun`` launch of several processes: :func:`random_model`'s model split over the ranks by
    transformers' tensor parallelism (``from_pretrained(folder, tp_plan="auto")``).

    transformers splits a model as it loads a checkpoint, so rank 0 builds the random weights on its device and
    writes them to ``folder`` (safetensors; default ``<temp dir>/kvcompress-random-<shape>-<dtype>-seed<seed>``);
    a later launch with the same folder loads them again without building (the folder holds :data:`READY` once
    they are complete: 16 GB at the Llama-3-8B shape in bf16).  The ranks wait for rank 0, then each loads its
    shard.  The process group is set up here when the launch has none yet (NCCL with CUDA, else gloo)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
    dtype_name = str(dtype).replace("torch.", "")
    folder = folder or os.path.join(tempfile.gettempdir(), f"kvcompress-random-{shape}-{dtype_name}-seed{seed}")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(folder, READY)):
        model = random_model(shape, f"cuda:{local}" if cuda else "cpu", dtype, seed, **overrides)
        model.save_pretrained(folder)
        del model
        if cuda:
            torch.cuda.empty_cache()
        Path(folder, READY).write_text(f"{shape} {dtype_name} seed {seed} {overrides}\n")
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=dtype)
    model.eval().requires_grad_(False)
    model.config._name_or_path = f"random-{shape}"
    model.generation_config.eos_token_id = None
    return model


def describe_model(model: Any) -> dict[str, Any]:
    c = model.config
    return {"name": getattr(c, "_name_or_path", "") or type(model).__name__, "layers": c.num_hidden_layers,
            "hidden": c.hidden_size, "q_heads": c.num_attention_heads,
            "kv_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            "intermediate": getattr(c, "intermediate_size", None), "vocab": c.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters()),
            "tensor_parallel": getattr(model, "_tp_size", None) or 1}


def dense_bytes_per_token(model: Any) -> int:
    """Bytes of one token of the uncompressed cache in the model's dtype (keys and values, every layer) that this
    process holds: under tensor parallelism its rank's KV heads."""
    from ..adapters import hf

    d = describe_model(model)
    shard = hf.head_shard(model)
    heads = shard.local_kv_heads if shard is not None else d["kv_heads"]
    return d["layers"] * heads * d["head_dim"] * 2 * next(model.parameters()).element_size()


# ----------------------------------------------------------------------------- one row


@dataclasses.dataclass(frozen=True)
class RowSpec:
    kind: str          #: one of ROW_KINDS
    label: str
    stack: Any = None  #: a Stack for kind "eager" / "compiled"

    @property
    def compiled(self) -> bool:
        return self.kind in ("static", "compiled", "graph")


def row_specs(stacks: Sequence[Any], *, eager: bool = True, compile: bool = False, graph: bool = False
              ) -> list[RowSpec]:
    """The rows of one point: plain eager, StaticCache + compile, then each stack eager and compiled
    (``graph``: also compiled and replayed as kvcompress' own CUDA graph, :class:`kvcompress.graphs.GraphStep`)."""
    rows = []
    if eager:
        rows.append(RowSpec("dynamic", "transformers DynamicCache"))
    if compile:
        rows.append(RowSpec("static", "transformers StaticCache + compile"))
    for st in stacks:
        if eager:
            rows.append(RowSpec("eager", st.label, st))
        if compile:
            rows.append(RowSpec("static-eager", f"{st.label} static", st))
            rows.append(RowSpec("compiled", f"{st.label} + compile", st))
            if graph:
                rows.append(RowSpec("graph", f"{st.label} + compile + CUDA graph", st))
    return rows


def _counter(group: str, key: str) -> int:
    from torch._dynamo.utils import counters

    return int(counters[group][key])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kernel_events(prof: Any):
    """``(name, µs)`` of each CUDA kernel a ``torch.profiler`` run recorded (memory copies and sets excluded)."""
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if evt.name.startswith(("Memcpy", "Memset", "[memory]")):
            continue
        try:
            us = evt.self_device_time_total
        except (AssertionError, AttributeError):  # older FunctionEvent APIs
            us = evt.time_range.elapsed_us()
        yield evt.name, us


def kernel_time(prof: Any) -> tuple[float, int]:
    """(summed duration in ms, count) of the CUDA kernels a ``torch.profiler`` run recorded
    (memory copies and sets excluded)."""
    total_us, count = 0.0, 0
    for _, us in _kernel_events(prof):
        total_us += us
        count += 1
    return total_us / 1e3, count


def kernel_table(prof: Any, steps: int, top: int = 60) -> list[dict[str, Any]]:
    """The CUDA kernels of a ``torch.profiler`` run over ``steps`` decode steps, by name (longest first):
    ``{"kernel", "per_step", "us_per_step"}`` for the ``top`` largest (memory copies and sets excluded, as in
    :func:`kernel_time`) - where a step's GPU time and launches go."""
    acc: dict[str, list[float]] = {}
    for name, us in _kernel_events(prof):
        a = acc.setdefault(name[:160], [0.0, 0.0])
        a[0] += 1
        a[1] += us
    rows = sorted(acc.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"kernel": k, "per_step": c / steps, "us_per_step": us / steps} for k, (c, us) in rows]


class _Decoder:
    """A cache for one row, its prefill and its decode step (eager or compiled)."""

    def __init__(self, model: Any, spec: RowSpec, batch: int, capacity: int, scope: contextlib.ExitStack):
        from ..adapters import hf
        from ..api import compress
        from .runner import compiled_step, graph_step, static_cache

        self.model, self.spec, self.batch = model, spec, batch
        self.device = next(model.parameters()).device
        self.kw = hf.cache_kwarg(model)
        self.hf = hf
        self.cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self.cache: Any = None
        if spec.kind == "static":
            self.cache = scope.enter_context(static_cache(model, None, capacity))
        elif spec.kind in ("compiled", "static-eager", "graph"):
            self.cache = scope.enter_context(static_cache(model, spec.stack, capacity, batch=batch))
        elif spec.kind == "eager":
            self.cache = scope.enter_context(compress(model, spec.stack))
        if spec.kind == "graph":
            self.fn = graph_step(model)  # captured during the benchmark's warm-up steps
        else:
            self.fn = compiled_step(model) if spec.compiled else model

    def _kwargs(self, pos: torch.Tensor) -> dict[str, Any]:
        """Keyword arguments of a forward call at positions ``pos`` (``[n]``, on the device)."""
        kw: dict[str, Any] = {"position_ids": pos.unsqueeze(0).repeat(self.batch, 1), "logits_to_keep": 1}
        if self.cache_position:
            kw["cache_position"] = pos
        if self.cache is not None:
            kw[self.kw] = self.cache
        else:
            kw["use_cache"] = True
        return kw

    def prefill(self, ids: torch.Tensor, chunk: int, progress: bool = False) -> None:
        """Eager prefill of ``ids`` (``[batch, ctx]``, any device) in chunks of ``chunk`` tokens per row; with
        ``progress``, a line at every tenth of the prompt (a large batch's prefill takes minutes)."""
        ctx = ids.shape[1]
        t0, shown = time.perf_counter(), 0
        for s in range(0, ctx, chunk):
            if progress and s * 10 // ctx > shown:
                shown = s * 10 // ctx
                _log(f"  prefill {s}/{ctx} tokens per row x {ids.shape[0]} rows, {time.perf_counter() - t0:.0f} s",
                     True)
            e = min(ctx, s + chunk)
            out = self.model(input_ids=ids[:, s:e].to(self.device),
                             **self._kwargs(torch.arange(s, e, device=self.device)))
            if self.cache is None:
                self.cache = self.hf.output_cache(out)
            del out

    def repeat_rows(self, batch: int) -> None:
        """After the prefill: serve ``batch`` rows, row ``i`` a copy of prefilled row ``i // ceil(batch / rows)``
        (``--fill-rows``)."""
        repeats = -(-batch // self.batch)
        if self.spec.stack is None:  # transformers' StaticCache
            self.hf.select_native_rows(self.cache, torch.arange(batch, device=self.device) // repeats)
        else:
            self.cache.batch_repeat_interleave(repeats)
            if repeats * self.batch != batch:
                self.cache.batch_select_indices(torch.arange(batch, device=self.device))
        self.batch = batch

    def prepare(self, start: int, count: int, vocab: int, seed: int) -> None:
        """Precompute the inputs of ``count`` decode steps from position ``start`` (on the device)."""
        g = torch.Generator().manual_seed(seed + 1)
        self.ids = torch.randint(vocab, (count, self.batch, 1), generator=g).to(self.device)
        pos = torch.arange(start, start + count, device=self.device)
        self.kwargs = [self._kwargs(pos[i:i + 1].clone()) for i in range(count)]

    def step(self, i: int) -> None:
        if self.spec.kind in ("static", "compiled") and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        self.fn(input_ids=self.ids[i], **self.kwargs[i])


def _alloc_stats(device: torch.device) -> tuple[int, int]:
    """(cudaMalloc calls, allocator retries) so far on ``device`` (zeros off CUDA)."""
    if device.type != "cuda":
        return 0, 0
    st = torch.cuda.memory_stats(device)
    return int(st.get("num_device_alloc", 0)), int(st.get("num_alloc_retries", 0))


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".replace("|", "/")


def _cleanup(device: torch.device) -> None:
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _row_template(model: Any, spec: RowSpec, batch: int, ctx: int, capacity: int, chunk: int) -> dict[str, Any]:
    """A latency row's fields before it is measured (the JSON schema of docs/evaluation.md)."""
    from .runner import compile_options, graph_compile_options

    device = next(model.parameters()).device
    return {
        "label": spec.label, "kind": spec.kind, "compiled": spec.compiled,
        "stack": spec.stack.to_dict() if spec.stack is not None else None,
        "stack_source": getattr(spec.stack, "source", None), "batch": batch, "context": ctx,
        "capacity": capacity if spec.compiled or spec.kind == "static-eager" else None, "prefill_chunk": chunk,
        "compile_options": (dict(graph_compile_options(device), cuda_graph="kvcompress GraphStep")
                            if spec.kind == "graph" else compile_options(device) if spec.compiled else None),
        "wall_ms": None, "wall_mean_ms": None, "wall_p10_ms": None, "wall_p90_ms": None, "step_ms": [],
        "gpu_busy_ms": None, "graph_variants": None, "graph_direct_timed": None,
        "kernels_per_step": None, "kernel_table": None, "wall_over_busy": None, "cache_bytes": None,
        "dense_bytes": capacity * batch * dense_bytes_per_token(model), "prefill_s": None,
        "compile_s": None, "warmup_s": None, "graphs": None, "recompiles": None, "graphs_after_warmup": None,
        "cudagraph_skips": None, "peak_bytes": None, "error": None, "traceback": None,
    }


def _wall_stats(row: dict[str, Any]) -> None:
    """``wall_ms`` (median) and the 10th / 90th percentiles of ``row["step_ms"]``."""
    xs = sorted(row["step_ms"])
    row["wall_ms"] = statistics.median(xs)
    row["wall_mean_ms"] = statistics.fmean(xs)
    row["wall_p10_ms"] = xs[round(0.1 * (len(xs) - 1))]
    row["wall_p90_ms"] = xs[round(0.9 * (len(xs) - 1))]


def _last_steps(dec: "_Decoder", row: dict[str, Any], first: int, total: int) -> None:
    """Steps ``first .. total - 1`` after the timed ones: on CUDA under torch.profiler (``gpu_busy_ms``,
    ``kernels_per_step``, ``wall_over_busy``), elsewhere unprofiled (the cache ends in the same state)."""
    n = total - first
    if dec.device.type == "cuda" and n:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(first, total):
                dec.step(i)
            _sync(dec.device)
        busy, kernels = kernel_time(prof)
        row["kernel_table"] = kernel_table(prof, n)
        del prof
        if kernels:
            row["gpu_busy_ms"] = busy / n
            row["kernels_per_step"] = kernels / n
            row["wall_over_busy"] = row["wall_ms"] / row["gpu_busy_ms"]
        return
    for i in range(first, total):
        dec.step(i)
    _sync(dec.device)


def graph_warmup(model: Any, stack: Any, capacity: int) -> int:
    """Decode steps after which a GraphStep (:func:`kvcompress.evaluation.runner.graph_step`, 2 direct calls) over
    a static cache of ``stack`` has captured the graph of every plan: the step that flushes a block is first met
    within one flush period (it compiles there) and captured at the next, so two periods of the longest flush
    and the first capture.  0 for a cache that never flushes (one plan)."""
    if stack is None:
        return 0
    from ..cache import Cache

    probe = Cache(stack, model, max_cache_len=capacity)  # nothing is allocated
    period = max((core.flush_size for core in probe.compressed_layers if core.flushes), default=0)
    return 2 * period + 3 if period else 0


def _graph_counts(dec: "_Decoder", row: dict[str, Any], direct_warm: int | None) -> None:
    """A GraphStep row: ``graph_variants`` (graphs captured: one per plan of the step, e.g. with and without a
    flush) and ``graph_direct_timed`` (timed or profiled steps that ran the compiled step directly instead of a
    graph - a plan first met after the warm-up, where that variant compiled: 0 when every one was a replay)."""
    if direct_warm is not None:
        row["graph_variants"] = len(dec.fn.variants)
        row["graph_direct_timed"] = dec.fn.direct_calls - direct_warm


def measure_row(model: Any, spec: RowSpec, batch: int, ctx: int, *, steps: int = 32, warmup: int = 3,
                profile_steps: int = 5, prefill_tokens: int = 32768, seed: int = 0,
                gate: Callable[[str], contextlib.AbstractContextManager] | None = None) -> dict[str, Any]:
    """Prefill ``ctx`` random tokens per row, then warm-up, timed and profiled decode steps (module doc).

    ``gate`` (optional): ``gate("prefill")`` is entered around the prefill and ``gate("time")`` from the end of
    the warm-up steps to the end of the profiled ones; a benchmark that prepares several rows in parallel
    processes uses it to prefill and time one row at a time.
    Never raises for a failure of the row itself: the row's ``error`` says what happened.
    """
    from .runner import cache_memory

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    if spec.kind == "graph":  # every plan's graph captured before the timed steps
        warmup = max(warmup, graph_warmup(model, spec.stack, ctx + warmup + steps + profile_steps))
    total = warmup + steps + profile_steps
    capacity = ctx + total
    chunk = max(1, min(ctx, prefill_tokens // batch))
    row = _row_template(model, spec, batch, ctx, capacity, chunk)
    row["warmup_steps"] = warmup
    vocab = model.config.vocab_size
    graphs0, skips0 = _counter("stats", "unique_graphs"), _counter("inductor", "cudagraph_skips")
    t_row = time.perf_counter()
    dec = None
    try:
        with contextlib.ExitStack() as scope, torch.no_grad():
            if cuda:
                _sync(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            dec = _Decoder(model, spec, batch, capacity, scope)
            prompt = torch.randint(vocab, (batch, ctx), generator=torch.Generator().manual_seed(seed))
            with gate("prefill") if gate is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                dec.prefill(prompt, chunk)
                _sync(device)
                row["prefill_s"] = time.perf_counter() - t0
            del prompt
            dec.prepare(ctx, total, vocab, seed)
            t0 = time.perf_counter()
            for i in range(warmup):
                dec.step(i)
            _sync(device)
            row["warmup_s"] = time.perf_counter() - t0
            if spec.compiled:
                row["compile_s"] = row["warmup_s"]
            graphs_warm = _counter("stats", "unique_graphs")
            direct_warm = getattr(dec.fn, "direct_calls", None)
            if gate is not None:
                scope.enter_context(gate("time"))
            times = []
            for i in range(warmup, warmup + steps):
                t0 = time.perf_counter()
                dec.step(i)
                _sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
            row["step_ms"] = times
            _wall_stats(row)
            _last_steps(dec, row, warmup + steps, total)
            _graph_counts(dec, row, direct_warm)
            graphs = _counter("stats", "unique_graphs") - graphs0
            if spec.compiled:
                row["graphs"] = graphs
                row["recompiles"] = max(0, graphs - 1)
                row["graphs_after_warmup"] = _counter("stats", "unique_graphs") - graphs_warm
                row["cudagraph_skips"] = _counter("inductor", "cudagraph_skips") - skips0
            row["cache_bytes"] = cache_memory(dec.cache)[0]
            if cuda:
                row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
            dec = None
    except Exception as exc:  # noqa: BLE001 - one failing row must not end the run
        row["error"] = _error(exc)
        row["traceback"] = traceback.format_exc()[-6000:]
    finally:
        dec = None  # drop the cache before the allocator's cached blocks are released
        _cleanup(device)
    row["row_s"] = time.perf_counter() - t_row
    return row


def measure_interleaved(model: Any, specs: Sequence[RowSpec], batch: int, ctx: int, *, rounds: int,
                        steps: int = 32, warmup: int = 3, profile_steps: int = 5, prefill_tokens: int = 32768,
                        seed: int = 0, progress: bool = False) -> list[dict[str, Any]]:
    """Eager rows (``dynamic`` / ``eager`` / ``static-eager``) of one point timed in ``rounds`` interleaved rounds.

    Every row's cache is prefilled first and kept; then each round times ``steps`` steps of every row in turn,
    so a slower stretch of a shared host slows every row alike (a host-bound eager step varies by +-15% from
    one minute to the next on the GPU machine).  ``wall_ms`` is the median over all timed steps of a row;
    ``round_ms`` the median of each round.  GPU-busy time, cache bytes and errors as :func:`measure_row`.
    Rows that fail at the prefill are reported with their error and leave the rounds."""
    from .runner import cache_memory

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    total = warmup + rounds * steps + profile_steps
    capacity = ctx + total
    chunk = max(1, min(ctx, prefill_tokens // batch))
    vocab = model.config.vocab_size
    rows, decoders = [], []
    with contextlib.ExitStack() as scope, torch.no_grad():
        for spec in specs:
            if spec.compiled:
                raise ValueError(f"measure_interleaved: {spec.label} is a compiled row (eager rows only)")
            row = _row_template(model, spec, batch, ctx, capacity, chunk)
            row.update(round_ms=[], rounds=rounds, row_s=0.0)
            rows.append(row)
            t_row = time.perf_counter()
            try:
                dec = _Decoder(model, spec, batch, capacity, scope)
                prompt = torch.randint(vocab, (batch, ctx), generator=torch.Generator().manual_seed(seed))
                t0 = time.perf_counter()
                dec.prefill(prompt, chunk)
                _sync(device)
                row["prefill_s"] = time.perf_counter() - t0
                dec.prepare(ctx, total, vocab, seed)
                t0 = time.perf_counter()
                for i in range(warmup):
                    dec.step(i)
                _sync(device)
                row["warmup_s"] = time.perf_counter() - t0
                decoders.append((row, dec))
            except Exception as exc:  # noqa: BLE001 - one failing row must not end the run
                row["error"] = _error(exc)
                row["traceback"] = traceback.format_exc()[-6000:]
            row["row_s"] += time.perf_counter() - t_row
            _log(f"  prepared {spec.label}" + (f": {row['error']}" if row["error"] else ""), progress)
        for row, _ in decoders:
            row["device_mallocs"] = row["alloc_retries"] = 0 if cuda else None
        for r in range(rounds):
            for row, dec in decoders:
                if row["error"]:
                    continue
                t_row = time.perf_counter()
                times = []
                stats0 = _alloc_stats(device)
                try:
                    for i in range(warmup + r * steps, warmup + (r + 1) * steps):
                        t0 = time.perf_counter()
                        dec.step(i)
                        _sync(device)
                        times.append((time.perf_counter() - t0) * 1e3)
                except Exception as exc:  # noqa: BLE001
                    row["error"] = _error(exc)
                    row["traceback"] = traceback.format_exc()[-6000:]
                if cuda:  # cudaMalloc calls / allocator retries (a free-and-retry is a device sync) while timed
                    stats1 = _alloc_stats(device)
                    row["device_mallocs"] += stats1[0] - stats0[0]
                    row["alloc_retries"] += stats1[1] - stats0[1]
                row["step_ms"] += times
                if times:
                    row["round_ms"].append(statistics.median(times))
                row["row_s"] += time.perf_counter() - t_row
            _log(f"  round {r + 1}/{rounds}: " + ", ".join(
                f"{row['label']} {row['round_ms'][-1]:.1f}" for row, _ in decoders if row["round_ms"]), progress)
        for row, dec in decoders:
            if row["error"]:
                continue
            _wall_stats(row)
            try:
                _last_steps(dec, row, warmup + rounds * steps, total)
                row["cache_bytes"] = cache_memory(dec.cache)[0]
            except Exception as exc:  # noqa: BLE001
                row["error"] = _error(exc)
                row["traceback"] = traceback.format_exc()[-6000:]
        decoders.clear()
    _cleanup(device)
    return rows


# ----------------------------------------------------------------------------- throughput


def _static_bytes(model: Any, spec: RowSpec, batch: int, ctx: int, prefill_tokens: int) -> int:
    """Bytes of ``spec``'s static cache of ``batch`` rows after a ``ctx``-token prefill."""
    from .runner import cache_memory

    device = next(model.parameters()).device
    dec = None
    try:
        with contextlib.ExitStack() as scope, torch.no_grad():
            dec = _Decoder(model, RowSpec("static" if spec.stack is None else "compiled", spec.label, spec.stack),
                           batch, ctx + 1, scope)
            dec.fn = model  # no compilation needed to size the cache
            prompt = torch.randint(model.config.vocab_size, (batch, ctx), generator=torch.Generator().manual_seed(0))
            dec.prefill(prompt, max(1, min(ctx, prefill_tokens // batch)))
            return cache_memory(dec.cache)[0]
    finally:
        dec = None
        _cleanup(device)


def measure_throughput(model: Any, spec: RowSpec, ctx: int, kv_bytes: float, *, steps: int = 32, warmup: int = 3,
                       max_batch: int = 1024, prefill_tokens: int = 32768, seed: int = 0,
                       progress: bool = False, fill_rows: int = 0) -> dict[str, Any]:
    """Largest batch whose cache fits ``kv_bytes``, its decode tokens/s (module doc); errors go in the row.
    ``fill_rows``: prefill only that many distinct rows and repeat them over the batch (0: every row)."""
    from .runner import cache_memory, compile_options

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    row: dict[str, Any] = {"label": spec.label, "kind": spec.kind,
                           "stack": spec.stack.to_dict() if spec.stack is not None else None,
                           "compile_options": compile_options(device), "context": ctx, "steps": steps,
                           "bytes_per_seq": None, "fixed_bytes": None, "batch": None, "cache_bytes": None,
                           "prefill_s": None, "compile_s": None, "decode_s": None, "decode_tok_s": None,
                           "step_ms": None, "peak_bytes": None, "graphs": None, "error": None, "traceback": None}
    t_row = time.perf_counter()
    dec = None
    try:
        one = _static_bytes(model, spec, 1, ctx, prefill_tokens)
        two = _static_bytes(model, spec, 2, ctx, prefill_tokens)
        per_seq, fixed = max(1, two - one), max(0, 2 * one - two)
        batch = int(min(max_batch, max(0, (kv_bytes - fixed) // per_seq)))
        row.update(bytes_per_seq=per_seq, fixed_bytes=fixed, batch=batch)
        if batch < 1:
            raise RuntimeError(f"one sequence ({per_seq} bytes) does not fit the budget")
        graphs0 = _counter("stats", "unique_graphs")
        with contextlib.ExitStack() as scope, torch.no_grad():
            if cuda:
                _sync(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            rows = min(batch, fill_rows) if fill_rows else batch
            dec = _Decoder(model, spec, rows, ctx + warmup + steps, scope)
            prompt = torch.randint(model.config.vocab_size, (rows, ctx), generator=torch.Generator().manual_seed(seed))
            t0 = time.perf_counter()
            dec.prefill(prompt, max(1, min(ctx, prefill_tokens // rows)), progress=progress)
            if rows < batch:
                dec.repeat_rows(batch)
            _sync(device)
            row["prefill_s"] = time.perf_counter() - t0
            row["prefilled_rows"] = rows
            del prompt
            dec.prepare(ctx, warmup + steps, model.config.vocab_size, seed)
            t0 = time.perf_counter()
            for i in range(warmup):
                dec.step(i)
            _sync(device)
            row["compile_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(warmup, warmup + steps):
                dec.step(i)
            _sync(device)
            row["decode_s"] = time.perf_counter() - t0
            row["step_ms"] = row["decode_s"] * 1e3 / steps
            row["decode_tok_s"] = batch * steps / row["decode_s"]
            row["cache_bytes"] = cache_memory(dec.cache)[0]
            row["graphs"] = _counter("stats", "unique_graphs") - graphs0
            if cuda:
                row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - before
            dec = None
    except Exception as exc:  # noqa: BLE001
        row["error"] = _error(exc)
        row["traceback"] = traceback.format_exc()[-6000:]
    finally:
        dec = None
        _cleanup(device)
    row["row_s"] = time.perf_counter() - t_row
    return row


# ----------------------------------------------------------------------------- the run


@dataclasses.dataclass
class E2EResult:
    mode: str                      #: "latency" or "throughput"
    settings: dict[str, Any]
    model: dict[str, Any]
    rows: list[dict[str, Any]]
    env: dict[str, Any]
    wall_s: float = 0.0
    complete: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "mode": self.mode, "settings": self.settings, "model": self.model,
                "rows": self.rows, "wall_s": self.wall_s, "complete": self.complete, "environment": self.env}

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "E2EResult":
        return cls(obj["mode"], obj["settings"], obj["model"], obj["rows"], obj["environment"], obj["wall_s"],
                   obj["complete"])

    def title(self) -> str:
        s, e = self.settings, self.env
        tp = self.model.get("tensor_parallel", 1)
        split = (f", split over {tp} tensor-parallel ranks: times of rank 0, bytes and budgets per rank" if tp > 1
                 else "")
        what = (f"{s['shape']} ({self.model['layers']} layers, {self.model['q_heads']}/{self.model['kv_heads']} "
                f"heads x {self.model['head_dim']}, random {s['dtype']} weights{split})")
        where = f"{e.get('gpu') or e.get('cpu')}, torch {e.get('torch')}, transformers {e.get('transformers')}, {e.get('date')}"
        if self.mode == "throughput":
            fill = (f" ({s['fill_rows']} distinct prompts prefilled, their cache rows repeated over the batch)"
                    if s.get("fill_rows") else "")
            return (f"decode throughput at a fixed KV budget of {s['kv_gib']} GiB: {what}, {s['context']}-token "
                    f"prompts{fill}, {s['steps']} decode steps; {where}")
        busy = (f", GPU-busy over {s['profile_steps']} profiled steps" if s["device"].startswith("cuda")
                else " (no GPU-busy time off CUDA)")
        return f"decode step: {what}, {s['steps']} timed steps after {s['warmup']} warm-up steps{busy}; {where}"

    def table(self, markdown: bool = False) -> str:
        rows = self.table_rows()
        return self.title() + "\n" + ("\n" + markdown_table(rows) if markdown else format_table(rows))

    def table_rows(self) -> list[list[str]]:
        def f(x: Any, fmt: str = "{:.2f}") -> str:
            return "-" if x is None else fmt.format(x)

        def mib(x: Any) -> str:
            if x is None:
                return "-"
            return f"{x / 2**20:,.0f}" if x >= 100 * 2**20 else f"{x / 2**20:.3g}"

        if self.mode == "throughput":
            base = next((r["decode_tok_s"] for r in self.rows if r.get("decode_tok_s")), None)
            rows = [["cache", "batch", "MiB/seq", "cache GiB", "peak GiB", "prefill s", "compile s", "ms/step",
                     "decode tok/s", "vs first", "note"]]
            for r in self.rows:
                rows.append([r["label"], f(r["batch"], "{}"), mib(r["bytes_per_seq"]),
                             f(None if r["cache_bytes"] is None else r["cache_bytes"] / 2**30),
                             f(None if r["peak_bytes"] is None else r["peak_bytes"] / 2**30),
                             f(r["prefill_s"], "{:.1f}"), f(r["compile_s"], "{:.1f}"), f(r["step_ms"]),
                             f(r["decode_tok_s"], "{:,.0f}"),
                             f(r["decode_tok_s"] / base if r["decode_tok_s"] and base else None, "{:.2f}x"),
                             r["error"] or ""])
            return rows
        rows = [["cache", "B x ctx", "wall ms/step", "vs plain eager", "GPU-busy ms/step", "wall/busy", "cache MiB",
                 "vs dense", "compile s", "graphs", "recompiles", "note"]]
        plain = {(r["batch"], r["context"]): r["wall_ms"] for r in self.rows
                 if r.get("kind") == "dynamic" and r.get("wall_ms")}
        for r in self.rows:
            dense = r.get("dense_bytes") or 0
            base = plain.get((r.get("batch"), r.get("context")))
            rows.append([r["label"], f"{r['batch']}x{r['context']}", f(r["wall_ms"]),
                         f(r["wall_ms"] / base if r["wall_ms"] and base else None, "{:.2f}x"), f(r["gpu_busy_ms"]),
                         f(r["wall_over_busy"], "{:.2f}x"), mib(r["cache_bytes"]),
                         f(r["cache_bytes"] / dense if r["cache_bytes"] and dense else None, "{:.3f}x"),
                         f(r["compile_s"], "{:.1f}"), f(r["graphs"], "{}"), f(r["recompiles"], "{}"),
                         r["error"] or ""])
        return rows


def load_result(path: str | os.PathLike) -> E2EResult:
    """A result from its ``--json`` file (complete or not), e.g. to print its table again:
    ``python -c "from kvcompress.evaluation.e2e import load_result as l; print(l('e2e.json').table(True))"``."""
    with open(path, encoding="utf-8") as fh:
        return E2EResult.from_dict(json.load(fh))


def _log(msg: str, enabled: bool) -> None:
    if enabled:
        print(f"[e2e] {msg}", file=sys.stderr, flush=True)


def run(model: Any, stacks: Sequence[Any], *, shape: str, points: Sequence[tuple[int, int]] = ((1, 32768), (8, 16384)),
        steps: int = 32, warmup: int = 3, profile_steps: int = 5, prefill_tokens: int = 32768, eager: bool = True,
        compile: bool = False, throughput: bool = False, kv_gib: float = 100.0, context: int = 32768,
        max_batch: int = 1024, time_budget: float | None = None, seed: int = 0, baseline: bool = True,
        fill_rows: int = 0, rounds: int = 0, on_row: Callable[[E2EResult], None] | None = None,
        progress: bool = True) -> E2EResult:
    """The benchmark (module doc) on ``model``; ``on_row`` is called with the partial result after each row.
    ``rounds`` (latency mode): time the eager rows of each point together in that many interleaved rounds
    (:func:`measure_interleaved`); 0: every row alone, one after the other."""
    from .runner import compile_options

    device = next(model.parameters()).device
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    settings = {"shape": shape, "dtype": dtype, "device": str(device), "steps": steps, "warmup": warmup,
                "prefill_tokens": prefill_tokens, "seed": seed, "time_budget_s": time_budget,
                "stacks": [st.label for st in stacks],
                "compile_options": compile_options(device) if (compile or throughput) else None}
    env = environment(device)
    env["cuda"] = torch.version.cuda
    if throughput:
        settings.update(kv_gib=kv_gib, context=context, max_batch=max_batch, baseline=baseline, fill_rows=fill_rows)
        specs = [RowSpec("static", "transformers StaticCache + compile")] if baseline else []
        specs += [RowSpec("compiled", f"{st.label} + compile", st) for st in stacks]
        jobs: list[tuple[RowSpec, Any]] = [(s, None) for s in specs]
    else:
        settings.update(points=[f"{b}x{c}" for b, c in points], profile_steps=profile_steps, eager=eager,
                        compile=compile)
        specs = row_specs(stacks, eager=eager, compile=compile, graph=compile and device.type == "cuda")
        jobs = [(s, p) for p in points for s in specs]
        if rounds:  # the eager rows of each point go first, timed together in interleaved rounds
            settings["interleaved_rounds"] = rounds
            eager_specs = [s for s in specs if not s.compiled]
            jobs = [j for p in points for j in [(tuple(eager_specs), p)] + [(s, p) for s in specs if s.compiled]
                    if not isinstance(j[0], tuple) or j[0]]
    result = E2EResult("throughput" if throughput else "latency", settings, describe_model(model), [], env)
    start = time.perf_counter()
    for n, (spec, point) in enumerate(jobs, 1):
        elapsed = time.perf_counter() - start
        where = "" if point is None else f" at B{point[0]}/{point[1]}"
        group = spec if isinstance(spec, tuple) else (spec,)
        label = ", ".join(s.label for s in group)
        if time_budget is not None and n > 1 and elapsed > time_budget:  # the first row always runs
            for one in group:
                row = {"label": one.label, "kind": one.kind,
                       "error": f"skipped: time budget of {time_budget:.0f} s spent"}
                if point is not None:
                    row.update(batch=point[0], context=point[1])
                result.rows.append(_skipped(row, throughput))
            _log(f"[{n}/{len(jobs)}] {label}{where}: skipped (time budget)", progress)
            if on_row is not None:
                on_row(result)
            continue
        _log(f"[{n}/{len(jobs)}] {label}{where} ...", progress)
        if throughput:
            row = measure_throughput(model, spec, context, kv_gib * 2**30, steps=steps, warmup=warmup,
                                     max_batch=max_batch, prefill_tokens=prefill_tokens, seed=seed,
                                     progress=progress, fill_rows=fill_rows)
            summary = (f"batch {row['batch']}, {row['decode_tok_s'] or 0:,.0f} tok/s" if not row["error"]
                       else row["error"])
        elif isinstance(spec, tuple):  # interleaved eager rows
            t_group = time.perf_counter()
            group_rows = measure_interleaved(model, spec, point[0], point[1], rounds=rounds, steps=steps,
                                             warmup=warmup, profile_steps=profile_steps,
                                             prefill_tokens=prefill_tokens, seed=seed, progress=progress)
            for row in group_rows:
                busy = "" if row["gpu_busy_ms"] is None else f", GPU-busy {row['gpu_busy_ms']:.2f} ms"
                summary = f"{row['wall_ms']:.2f} ms/step{busy}" if not row["error"] else row["error"]
                _log(f"[{n}/{len(jobs)}] {row['label']}{where}: {summary}", progress)
            result.rows.extend(group_rows)
            _log(f"[{n}/{len(jobs)}] eager rows{where} in {rounds} rounds ({time.perf_counter() - t_group:.1f} s)",
                 progress)
            result.wall_s = time.perf_counter() - start
            if on_row is not None:
                on_row(result)
            continue
        else:
            row = measure_row(model, spec, point[0], point[1], steps=steps, warmup=warmup,
                              profile_steps=profile_steps, prefill_tokens=prefill_tokens, seed=seed)
            busy = "" if row["gpu_busy_ms"] is None else f", GPU-busy {row['gpu_busy_ms']:.2f} ms"
            summary = f"{row['wall_ms']:.2f} ms/step{busy}" if not row["error"] else row["error"]
        _log(f"[{n}/{len(jobs)}] {spec.label}{where}: {summary} ({row['row_s']:.1f} s)", progress)
        result.rows.append(row)
        result.wall_s = time.perf_counter() - start
        if on_row is not None:
            on_row(result)
    result.wall_s = time.perf_counter() - start
    result.complete = True
    if on_row is not None:
        on_row(result)
    return result


def _skipped(row: dict[str, Any], throughput: bool) -> dict[str, Any]:
    keys = (("batch", "bytes_per_seq", "cache_bytes", "peak_bytes", "prefill_s", "compile_s", "step_ms",
             "decode_tok_s") if throughput else
            ("wall_ms", "gpu_busy_ms", "wall_over_busy", "cache_bytes", "compile_s", "graphs", "recompiles"))
    out = {k: None for k in keys}
    out.update(row)
    out.setdefault("dense_bytes", 0)
    return out


# ----------------------------------------------------------------------------- command line


def validate_args(args: Any) -> None:
    """Checks of the e2e options that need no model (``ConfigError`` names the option)."""
    if not args.random_weights:
        raise ConfigError("--random-weights", "given with --model-shape (a named shape has no trained weights)",
                          False)
    if args.model is not None:
        raise ConfigError("--model", "not given with --model-shape (the shape defines the model)", args.model)
    if args.points is None:
        args.points = DEFAULT_POINTS
    if args.model_shape not in SHAPES:
        raise ConfigError("--model-shape", "one of " + ", ".join(SHAPES), args.model_shape)
    if args.rounds is not None and (args.throughput or not 1 <= args.rounds <= 64):
        raise ConfigError("--rounds", "an integer in [1, 64] without --throughput (with --model-shape: the eager rows "
                          "of each point timed together in that many interleaved rounds of --steps steps)",
                          args.rounds)
    if not args.throughput and args.context is not None:
        raise ConfigError("--context", "not given with --model-shape unless --throughput (use --points BxCTX)",
                          args.context)
    for option, value, lo, hi in (("--steps", args.steps, 1, 1 << 16), ("--warmup", args.warmup, 0, 1 << 10),
                                  ("--profile-steps", args.profile_steps, 0, 1 << 10),
                                  ("--prefill-tokens", args.prefill_tokens, 1, 1 << 24),
                                  ("--max-batch", args.max_batch, 1, 1 << 16),
                                  ("--fill-rows", args.fill_rows, 0, 1 << 16)):
        if not lo <= value <= hi:
            raise ConfigError(option, f"an integer in [{lo}, {hi}]", value)
    if args.throughput:
        if not (args.kv_gib > 0 and math.isfinite(args.kv_gib)):
            raise ConfigError("--kv-gib", "a positive number of GiB", args.kv_gib)
        if args.context is not None and not 1 <= args.context <= (1 << 20):
            raise ConfigError("--ctx", "an integer in [1, 1048576]", args.context)
    elif args.no_baseline or args.fill_rows:
        raise ConfigError("--no-baseline" if args.no_baseline else "--fill-rows", "used together with --throughput",
                          True if args.no_baseline else args.fill_rows)
    elif not args.compile and args.no_eager:
        raise ConfigError("--no-eager", "used together with --compile (otherwise no row is left)", True)
    parse_points(args.points)
    check_stack_args(args.stack)


def main_from_args(args: Any, device: str) -> int:
    """``kvcompress bench --model-shape ...`` (also ``benchmarks/e2e_decode.py``): build, run, print, write."""
    validate_args(args)
    dtype = getattr(torch, args.dtype)
    progress = not args.quiet
    t0 = time.perf_counter()
    from ..distributed import launched_ranks

    ranks = launched_ranks()
    if ranks > 1:  # torchrun: the model split over the ranks (tensor parallelism), each rank measuring its share
        model = tp_random_model(args.model_shape, dtype, args.seed, getattr(args, "weights_dir", None))
        where = f"split over {ranks} ranks (tensor parallelism)"
    else:
        model = random_model(args.model_shape, device, dtype, args.seed)
        where = f"on {device}"
    _log(f"built {args.model_shape} with random {args.dtype} weights {where} in {time.perf_counter() - t0:.1f} s",
         progress)
    stacks = resolve_stacks(args.stack, model)

    def write(result: E2EResult) -> None:
        if args.json and _is_rank0():  # under torchrun rank 0 writes
            tmp = f"{args.json}.tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(result.to_dict(), fh, indent=1)
                fh.write("\n")
            os.replace(tmp, args.json)

    result = run(model, stacks, shape=args.model_shape, points=parse_points(args.points), steps=args.steps,
                 warmup=args.warmup, profile_steps=args.profile_steps, prefill_tokens=args.prefill_tokens,
                 eager=not args.no_eager, compile=args.compile, throughput=args.throughput, kv_gib=args.kv_gib,
                 context=args.context if args.context is not None else 32768, max_batch=args.max_batch,
                 time_budget=args.time_budget, seed=args.seed, baseline=not args.no_baseline,
                 fill_rows=args.fill_rows, rounds=args.rounds or 0, on_row=write, progress=progress)
    print(result.table(markdown=args.markdown))
    if args.json:
        print(f"wrote {args.json}")
    return 0
