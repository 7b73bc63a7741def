"""Timing utilities and the per-kernel benchmark of every op in ``kvcompress.kernels`` (issue 19's grid).

Timing (:func:`time_op`):

* **CUDA**: each timed call reads its own copy of the inputs, rotating over at least
  :data:`ROTATE_BYTES` (400 MB, several times the 60 MB L2 of an H200) so every call
  streams from HBM (a cold L2), as a decode step does.  The calls over all copies are
  captured in one CUDA graph (falling back to eager launches if capture fails), the
  graph is replayed ``reps`` times between CUDA events, and the median replay time
  divided by the number of calls is reported.
* **CPU**: wall clock (``time.perf_counter``) around single calls, median of ``reps``.

The grid (:func:`grid`): Llama-3-8B heads (``llama3-8b``: 32 query / 8 kv heads, d = 128) and SmolLM2 heads
(``smollm2-135m``: 9 / 3, d = 64), B in {1, 4, 16, 64}, ctx in {4k, 32k, 128k}; a row whose data does not fit in
device memory is recorded as ``skipped`` (the estimate is made before allocating).  ``--quick``: Llama B1 / 32k,
Llama B16 / 32k, SmolLM2 B16 / 32k.  On the CPU: B1 / 4k at both head shapes, the PyTorch references only.

Ops (``--ops``, default :data:`ALL_OPS`):

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on the uncompressed fp16 cache (GQA rows folded
  into the query length; the fastest of cuDNN / flash / efficient), **the baseline of every row's ``vs SDPA``**;
  ``dense-ref``: the dense partial-attention reference on the same cache;
* ``kivi2`` / ``kivi4``: the KIVI partial attention the compressor runs (2 / 4 bits, key group 32, value group 32)
  over ``ctx`` packed tokens: ``kernels.kivi.kivi_attention_partial``, i.e. the CUDA kernel (v3) when nvcc is
  available, else the Triton kernel (v2); the row's ``impl`` names it.  ``kivi2-triton`` / ``kivi4-triton``: the
  Triton kernel (v2) itself; ``kivi2-ref`` / ``kivi4-ref``: its PyTorch reference, small shapes only;
* ``leank50`` / ``leank70``: the grouped LeanK lanes kernel over a pruned middle of ``ctx - 1024`` tokens (kept
  channels per head :data:`LEANK_COUNTS`) plus the 1024 full-precision sink + window tokens, one launch;
* ``ds8`` / ``ds16`` (``-shared``): one DoubleSparse decode read (fused label scoring + exact top-k of ctx/8 or
  ctx/16 tokens per query head, or per kv head when shared, + gather attention; the select and the gather in one
  kernel where a model's read takes it: ``fuse_rule``); the extra ops ``ds8-fused`` ... ``ds16-shared-fused``: always
  the one kernel (``select_gather_partial``);
* ``none``, ``kivi2-static``, ``leank70-kivi2``, ``lowrank``: the decode read of a **static cache** (``Cache(..., max_cache_len=ctx +
  128)``) of that stack holding ``ctx`` tokens - exactly ``StaticLayer._read``, what a decode step runs after
  writing its token: the sinks + recent-window buffer and the middle store's segments, each read by the op the
  layer and its stores chose when they were built (``kernels.ops.choose``), merged by log-sum-exp.  The layer is
  built by kvcompress itself (``StackPipeline`` of the built-in compressors, ``StaticLayer.allocate``) and filled
  through its own prefill commit (sinks, ring, flushes through the stack's pipeline into its store, encoded by the
  store's encoder), so the layout is the real one.  ``none``: the empty stack, one fp16 buffer read by the lanes
  kernel up to its written prefix (``length``); ``kivi2-static``: KIVI-2 as its compressor lays a layer out (the
  128-token residual window + one 32-token group in full precision, the rest quantized): on CUDA the KIVI kernel
  reads the buffer and the quantized middle in ONE launch (``kvcompress::kivi_buffer_partial``, impl ``kivi:cuda``),
  else the lanes kernel, the KIVI kernel and the merge; ``leank70-kivi2``: ``examples/stacks/leank70_kivi.yaml`` (LeanK
  70 % with :data:`LEANK_COUNTS` kept channels, 128 sinks, 768-token window, 128-token flushes, then KIVI-2 G = 32
  on the regrouped lanes): one lanes launch (+ merge) for the buffer plus ONE launch (+ merge) for every KIVI lane
  - at small reads (the KIVI kernel's ``fuses_buffer`` rule) the buffer in that same launch
  (``kvcompress::kivi_lanes_buffer_partial``, since session 31) -
  (``kvcompress::kivi_lanes_partial``: the CUDA lanes kernel, :mod:`kvcompress.kernels.kivi.lanes_cuda`, impl
  ``kivi-lanes:cuda``, where nvcc is found, else the Triton one, :mod:`kvcompress.kernels.kivi.lanes_triton`; the
  extra op ``leank70-kivi2-triton`` is the same layer read by the Triton lanes kernel; before that: one KIVI launch,
  a query gather and a head scatter per lane, ``kivi:cuda``, the extra op ``leank70-kivi2-perlane``); ``lowrank``:
  ``examples/stacks/lowrank.yaml`` at rank r = d/2 (a random orthonormal basis per kv
  head; the middle keys stored as r coordinates, the query projected; one lanes launch, which projects the query in
  its programs since session 31 - before, a projection GEMM, casts and the projected query appended);
* ``paged-dense``: the dynamic paged pool (``kvcompress.paged.PagedStore``, 16-token pages, what
  ``paged_eviction`` builds in a dynamic cache) holding ``ctx`` tokens per row, read in place through its block
  tables by the paged kernel (``PagedView.attention_partial``); the pool is written by the store's own ``append``;
* ``paged-kivi2``: KIVI-2 pages read in place: the static paged pool (``kvcompress.paged.StaticPagedStore`` with
  the KIVI codec, 32-token pages, what ``paged_eviction`` + ``kivi`` builds in a static cache), one region per row
  read by the KIVI kernel the store chose (``PackedKV.attention_partial``).  Extra op, not in the default set:
  ``paged-kivi2-gather``, the dynamic pool's KIVI pages as a dynamic cache reads them today (gathered through the
  block table into a transient region, then the KIVI kernel).

Each row: ``latency_us`` (median), ``bytes`` - what the op must read at minimum (K / V or codes, scales and zero
points, over the live prefix; valid masks and channel lists once per kv head; block tables and page flags once per
kv head; the query) - ``bandwidth_tbps`` on those bytes, ``pct_of_peak`` (percent of 4.3 TB/s, the H200's
measured copy bandwidth; ``pct_of_4p3`` is the same number under its older name), ``speedup_vs_sdpa``,
``bytes_vs_fp16`` (the uncompressed cache's bytes over the row's), ``impl`` where the op has a choice, and the
timing method.  A row that could not run says why: ``skipped`` (memory estimate) or ``error`` (the exception:
one op failing at one shape - out of memory included - never ends the run).

Run: ``python -m kvcompress.kernels.benchutil [--device cuda] [--out results.json]`` (or ``kvcompress bench
--kernels``), with

* ``--quick``: the three shapes above; ``--ops a,b``: these ops only, ``--ops grid``: issue 19's ops
  (:data:`GRID_OPS`), ``--ops all``: every op (``--list-ops`` names them);
* ``--models llama3-8b,smollm2-135m``, ``--batches 1,4``, ``--contexts 4k,32k``: restrict the grid;
  ``--only-shapes llama3-8b:16:32k,smollm2-135m:1:128k``: exactly these (model:B:ctx) shapes;
* ``--out f.json``: written after every shape (a run cut by a time limit keeps what it measured), with the shapes
  done; ``--resume``: read ``--out`` first and skip the shapes it has done (rerun a cut command to finish it);
* ``--max-seconds S``: start no shape after S seconds (the JSON lists the shapes left in ``remaining``);
* ``--dry-run``: print the shapes and exit.  Progress lines go to stderr, the markdown table to stdout.

Splitting the full grid over GPU calls of at most 9 minutes (estimated from ``docs/data/kernels_h200_v3.json``: that
run timed 72 rows - 18 shapes x sdpa, kivi2, kivi4, kivi2-triton - in 60 s including data generation, about 0.8 s
per row; the static-cache and pool rows also build their layer or pool, a few seconds at B64 / 128k and a deep copy
per rotated copy at small shapes, so count 2-3 s per row): ``--ops grid`` (:data:`GRID_OPS`, 15 rows per shape) takes
about 30-45 s per shape, so the 6 shapes of one model and two batch sizes take 3-5 minutes, plus the first call's
Triton compilations and KIVI CUDA build on a fresh machine.  Four calls cover the grid::

    --models llama3-8b --batches 1,4        --models llama3-8b --batches 16,64
    --models smollm2-135m --batches 1,4     --models smollm2-135m --batches 16,64

each as (from the repository root of the device machine; the package is installed under /tmp/site as
``benchmarks/gpu_decode.sh`` does, and run from there so that the checkout's ``kvcompress/`` does not shadow it)::

    O=$(realpath "$OUT"); mkdir -p /tmp/site
    python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site .
    cd /tmp/site && PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 timeout 560
      python -m kvcompress.kernels.benchutil --device cuda --ops grid --models llama3-8b --batches 1,4
      --max-seconds 420 --resume --out "$O/kernels_llama_b1_4.json" > "$O/kernels_llama_b1_4.md"

(the last command is one line; progress on stderr).  A call that stops early lists the shapes left in the JSON's
``remaining``: copy its JSON into the working tree, ``cp`` it to ``$O`` before the run and give the same command
again (``--resume`` skips the shapes done).  The largest shape, Llama B64 / 128k, holds 34 GB per fp16 copy (SDPA,
``none`` and ``paged-dense`` run with one copy each; ``paged-dense`` needs about 80 GB while its pool grows).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch

ROTATE_BYTES = 400 * 1024**2
H200_BANDWIDTH = 4.3e12  # measured device-copy floor, bytes/s (see the project's performance notes)
PEAK_TBPS = H200_BANDWIDTH / 1e12
MAX_COPIES = 2048  # rotated input copies of one row at most (graph capture time)


# ----------------------------------------------------------------------------- timing


@dataclasses.dataclass
class Timing:
    """Median seconds per call, with how it was measured."""

    seconds: float
    calls: int  # distinct input copies rotated over
    reps: int
    method: str  # "cuda-graph", "cuda-events" or "wall-clock"
    spread: float  # (max - min) / median over the replays

    @property
    def us(self) -> float:
        return self.seconds * 1e6


def _cuda_sync(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)


def copies_for(bytes_per_call: int, rotate_bytes: int = ROTATE_BYTES) -> int:
    """Number of distinct input copies so that one pass over them streams ``rotate_bytes``."""
    return max(1, math.ceil(rotate_bytes / max(1, bytes_per_call)))


def time_op(fn: Callable[..., Any], inputs: Sequence[tuple], *, reps: int | None = None, warmup: int = 3,
            graph: bool = True, device: str | torch.device | None = None) -> Timing:
    """Median time of ``fn(*args)`` per call, rotating over ``inputs`` (a list of argument tuples).

    On CUDA the inputs should be distinct buffers totalling at least :data:`ROTATE_BYTES`
    (see :func:`copies_for`) so each call reads from HBM.  On CPU one argument tuple suffices.
    """
    dev = torch.device(device) if device is not None else None
    if dev is None:
        first = next((a for args in inputs for a in args if isinstance(a, torch.Tensor)), None)
        dev = first.device if first is not None else torch.device("cpu")
    if dev.type != "cuda":
        reps = reps or 10
        for _ in range(warmup):
            fn(*inputs[0])
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(*inputs[i % len(inputs)])
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        return Timing(med, 1, reps, "wall-clock", (max(times) - min(times)) / med)

    reps = reps or 20
    n = len(inputs)
    for args in inputs[: min(n, warmup)]:  # compile / autotune / allocate outside the timing
        fn(*args)
    _cuda_sync(dev)

    def run_all() -> None:
        for args in inputs:
            fn(*args)

    replay = run_all
    method = "cuda-events"
    if graph:
        try:
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                run_all()  # warm the graph's allocations on a side stream, as torch.cuda.graphs requires
            torch.cuda.current_stream(dev).wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run_all()
            replay = g.replay
            method = "cuda-graph"
        except Exception:  # capture is an optimisation: fall back to eager launches
            _cuda_sync(dev)
            replay = run_all
            method = "cuda-events"
    replay()
    _cuda_sync(dev)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / n)
    med = statistics.median(times)
    return Timing(med, n, reps, method, (max(times) - min(times)) / med)


# ----------------------------------------------------------------------------- benchmark cases


@dataclasses.dataclass(frozen=True)
class Shape:
    model: str
    q_heads: int
    kv_heads: int
    head_dim: int


SHAPES = (Shape("llama3-8b", 32, 8, 128), Shape("smollm2-135m", 9, 3, 64))
BATCHES = (1, 4, 16, 64)
CONTEXTS = (4096, 32768, 131072)
QUICK = ((SHAPES[0], 1, 32768), (SHAPES[0], 16, 32768), (SHAPES[1], 16, 32768))
CPU_BATCHES, CPU_CONTEXTS = (1,), (4096,)  # the references on the CPU: small shapes
KEY_GROUP = 32
VALUE_GROUP = 32


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return 8 * 1024**3  # CPU runs use tiny shapes


def kivi_inputs(batch: int, kv_heads: int, tokens: int, head_dim: int, bits: int, group: int, v_group: int,
                m: int, device: torch.device, gen: torch.Generator | None = None, dtype=torch.float16):
    """Random packed KIVI data (all slots valid) and grouped queries in ``dtype`` (the model's); codes use every bit
    pattern; scales and zero points fp16 whatever the model's dtype, as the KIVI stores hold them
    (``kivi.reference.quantize_groups``)."""
    from .kivi.reference import PackedKV

    per = 32 // bits
    ng = tokens // group
    kw = (batch, kv_heads, ng, head_dim // per, group)
    vw = (batch, kv_heads, tokens, head_dim // per)

    def words(shape):
        return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=device, generator=gen)

    def scale(shape):
        return (torch.rand(shape, device=device, generator=gen) * 0.5 + 0.05).to(torch.float16)

    def zero(shape):
        return (torch.randn(shape, device=device, generator=gen) * 0.5).to(torch.float16)

    ks = (batch, kv_heads, ng, head_dim)
    packed = PackedKV(bits, group, words(kw), scale(ks), zero(ks), words(vw),
                      scale(vw[:3] + (head_dim // v_group,)), zero(vw[:3] + (head_dim // v_group,)),
                      torch.ones(batch, tokens, dtype=torch.bool, device=device))
    q = torch.randn(batch, kv_heads, m, head_dim, device=device, dtype=dtype, generator=gen)
    return q, packed


# LeanK kept-channel counts per kv head (head_dim 128; scaled by head_dim / 128), a paper-like mix of
# 0/32/64/96/128: the count-0 head keeps neither middle K nor middle V.
LEANK_COUNTS = {50: (0, 32, 64, 64, 64, 96, 96, 96), 70: (0, 32, 32, 32, 32, 32, 64, 96)}
LEANK_FP_TOKENS = 1024  # sinks 128 + local window 896 (full precision, all channels)


def leank_counts(ratio: int, kv_heads: int, head_dim: int) -> list[int]:
    """Kept channels per kv head for a pruning ``ratio`` (50 or 70 %), cycling the mix over the heads."""
    mix = LEANK_COUNTS[ratio]
    return [mix[i % len(mix)] * head_dim // 128 for i in range(kv_heads)]


def leank_inputs(batch: int, kv_heads: int, middle: int, head_dim: int, m: int, ratio: int, device: torch.device,
                 gen: torch.Generator | None = None, fp_tokens: int = LEANK_FP_TOKENS, dtype=torch.float16):
    """Grouped query and LeanK lanes: one dense lane per kept count (the middle) plus the full-precision region."""
    from .leank.reference import Lane

    counts = leank_counts(ratio, kv_heads, head_dim)
    lanes = []
    for c in sorted(set(counts) - {0}, reverse=True):
        heads = [h for h, n in enumerate(counts) if n == c]
        channels = torch.stack([torch.randperm(head_dim, device=device, generator=gen)[:c].sort().values
                                for _ in heads])
        lanes.append(Lane(torch.tensor(heads, device=device), channels,
                          torch.randn(batch, len(heads), middle, c, device=device, dtype=dtype, generator=gen),
                          torch.randn(batch, len(heads), middle, head_dim, device=device, dtype=dtype, generator=gen),
                          None))
    if fp_tokens:
        lanes.append(Lane(None, None, torch.randn(batch, kv_heads, fp_tokens, head_dim, device=device, dtype=dtype,
                                                  generator=gen),
                          torch.randn(batch, kv_heads, fp_tokens, head_dim, device=device, dtype=dtype, generator=gen),
                          None))
    q = torch.randn(batch, kv_heads, m, head_dim, device=device, dtype=dtype, generator=gen)
    return q, lanes


def leank_bytes(q: torch.Tensor, lanes) -> int:
    """Bytes the LeanK kernel reads: every lane's K and V (plus valid masks and channel lists) and the query."""
    n = q.numel() * q.element_size()
    for lane in lanes:  # fields by name: Lane grows (the low-rank basis)
        k, v, valid, channels = lane.k, lane.v, lane.valid, lane.channels
        n += k.numel() * k.element_size() + v.numel() * v.element_size()
        n += 0 if valid is None else valid.numel() * k.shape[1]
        n += 0 if channels is None else channels.numel() * channels.element_size()
        n += 0 if lane.basis is None else lane.basis.numel() * lane.basis.element_size()
    return n


def kivi_bytes(q: torch.Tensor, packed) -> int:
    """Bytes the KIVI kernel reads: codes, scales, zeros, the valid mask once per kv head, the query."""
    t = [packed.k_codes, packed.k_scale, packed.k_zero, packed.v_codes, packed.v_scale, packed.v_zero]
    heads = packed.k_codes.shape[1]
    return sum(x.numel() * x.element_size() for x in t) + packed.valid.numel() * heads + q.numel() * q.element_size()


def dense_inputs(batch: int, kv_heads: int, tokens: int, head_dim: int, m: int, device: torch.device,
                 gen: torch.Generator | None = None, dtype=torch.float16):
    k = torch.randn(batch, kv_heads, tokens, head_dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(batch, kv_heads, tokens, head_dim, device=device, dtype=dtype, generator=gen)
    q = torch.randn(batch, kv_heads, m, head_dim, device=device, dtype=dtype, generator=gen)
    return q, k, v


def _sdpa_fn(backend: str | None):
    import torch.nn.functional as F

    def run(q, k, v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return F.scaled_dot_product_attention(q, k, v)

    return run


# ----------------------------------------------------------------------------- static-cache reads (stacks)

#: regions of the LeanK / low-rank example stacks (examples/stacks/leank70_kivi.yaml, lowrank.yaml): 128 sinks, a
#: 768-token window and 128-token flushes (KIVI's residual: 128, its group 32)
REGIONS = {"sinks": 128, "window": 768, "flush": 128}
#: a static cache's ``max_cache_len`` in these rows: the context plus this many tokens still to decode
CAPACITY_SLACK = 128
#: K bytes per chunk when a layer or pool is filled (bounds the transient memory of building a large one)
FILL_CHUNK_BYTES = 256 * 1024**2
STATIC_OPS = ("none", "kivi2-static", "leank70-kivi2", "lowrank", "leank70-kivi2-perlane", "leank70-kivi2-triton")


def leank_keep(ratio: int, kv_heads: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """A LeanK keep mask ``[1 layer, kv_heads, head_dim]`` (bool, CPU, as a mask file holds it) keeping
    :func:`leank_counts` random channels per kv head."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.zeros(1, kv_heads, head_dim, dtype=torch.bool)
    for h, count in enumerate(leank_counts(ratio, kv_heads, head_dim)):
        keep[0, h, torch.randperm(head_dim, generator=g)[:count]] = True
    return keep


def lowrank_basis(kv_heads: int, head_dim: int, rank: int, seed: int = 0) -> torch.Tensor:
    """A random orthonormal key basis ``[kv_heads, head_dim, rank]`` (float32, CPU, as a basis file holds it)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(kv_heads, head_dim, head_dim, generator=g))
    return q[..., :rank].contiguous()


def static_stack(op: str, shape: Shape, regions: dict | None = None):
    """``(entries, setup)`` of the stack a static-read row builds: ``entries`` ``[(compressor, params)]`` as in the
    example stack files, ``setup(compressors)`` gives the compressors what they would load from a mask or basis file
    (there is none for these head shapes): LeanK's keep mask (:func:`leank_keep`, 70 %), the low-rank basis
    (:func:`lowrank_basis`, r = d / 2)."""
    r = {**REGIONS, **(regions or {})}
    if op == "none":
        return [], None
    if op == "kivi2-static":  # KIVI's own layout: no sinks, the residual window of 128 + one group in flight
        return [("kivi", {"bits": 2, "group": KEY_GROUP, "residual": r["flush"]})], None
    if op in ("leank70-kivi2", "leank70-kivi2-perlane", "leank70-kivi2-triton"):
        keep = leank_keep(70, shape.kv_heads, shape.head_dim)

        def setup(compressors):
            compressors[0][1].keep = keep

        return [("leank", {"sinks": r["sinks"], "local": r["window"], "flush": r["flush"]}),
                ("kivi", {"bits": 2, "group": KEY_GROUP, "residual": r["flush"]})], setup
    if op == "lowrank":
        basis = lowrank_basis(shape.kv_heads, shape.head_dim, shape.head_dim // 2)

        def setup(compressors):  # what LowRankCompressor.load makes of a basis file: (heads, U, value basis)
            compressors[0][1].groups = [[(torch.arange(shape.kv_heads), basis, None)]]

        return [("lowrank", {"basis": "", "rank": shape.head_dim // 2, "sinks": r["sinks"], "recent": r["window"],
                             "flush": r["flush"]})], setup
    raise ValueError(f"unknown static-read op {op!r}; one of {STATIC_OPS}")


#: compressor name -> (module of kvcompress.plugins, config class, compressor class): what each plugin registers
#: (imported directly: no entry-point lookup, so an uninstalled source tree on PYTHONPATH works too)
_COMPRESSORS = {"leank": ("leank", "LeanKConfig", "LeanKCompressor"), "kivi": ("kivi", "KiviConfig", "KiviCompressor"),
                "lowrank": ("lowrank", "LowRankConfig", "LowRankCompressor")}


def build_static_layer(op: str, shape: Shape, batch: int, ctx: int, device, gen: torch.Generator | None = None, *,
                       dtype: torch.dtype = torch.float16, regions: dict | None = None, kv=None,
                       chunk_bytes: int = FILL_CHUNK_BYTES):
    """A :class:`kvcompress.static.StaticLayer` of stack ``op`` (:data:`STATIC_OPS`), ``max_cache_len = ctx +``
    :data:`CAPACITY_SLACK`, holding ``ctx`` tokens of every row (random, or ``kv = (K, V)`` ``[B, Hkv, ctx, d]``).

    Built as a cache builds it (the built-in compressors in a ``StackPipeline``, ``StaticLayer.allocate``: the
    stores and the read kernels chosen by the layer itself) and filled through the layer's own prefill commit
    (:func:`fill_static_layer`)."""
    import importlib

    from kvcompress.pipeline import StackPipeline
    from kvcompress.state import LayerInfo
    from kvcompress.static import StaticLayer

    entries, setup = static_stack(op, shape, regions)
    compressors = []
    for name, params in entries:  # the built-in compressors, as their registered specs build them
        module, config, factory = _COMPRESSORS[name]
        plugin = importlib.import_module(f"kvcompress.plugins.{module}")
        compressors.append((name, getattr(plugin, factory)(getattr(plugin, config)(**params))))
    if setup is not None:
        setup(compressors)
    info = LayerInfo(0, 1, shape.kv_heads, shape.q_heads, shape.head_dim)
    layer = StaticLayer(info, StackPipeline(compressors), ctx + CAPACITY_SLACK)
    layer.allocate(batch, shape.kv_heads, shape.head_dim, shape.head_dim, dtype, torch.device(device))
    fill_static_layer(layer, ctx, gen, kv=kv, chunk_bytes=chunk_bytes)
    if op == "leank70-kivi2-perlane" and getattr(layer.middle, "merged", None) is not None:
        layer.middle.merged = layer.middle._region = None  # the read before kivi_lanes_partial: a segment per lane
    if op == "leank70-kivi2-triton" and getattr(layer.middle, "merged", None) is not None:
        layer.middle.lanes_kernel = "triton"  # the merged read on the Triton lanes kernel (before the CUDA one)
    return layer


def fill_static_layer(layer, tokens: int, gen: torch.Generator | None = None, *, kv=None,
                      chunk_bytes: int = FILL_CHUNK_BYTES) -> None:
    """Commit ``tokens`` tokens to ``layer`` as prefill chunks do, without their attention: ``StaticLayer._commit_host``
    (what ``StaticLayer._prefill`` runs after reading the chunk: sinks, the ring, every block that leaves the window
    through the stack's pipeline into the middle store), in chunks of at most ``chunk_bytes`` of K."""
    b, h, d, dv = layer.k.shape[0], layer.k.shape[1], layer.k.shape[-1], layer.v.shape[-1]
    dev, dtype, f = layer.k.device, layer.k.dtype, layer.flush_size
    chunk = max(f, chunk_bytes // max(1, b * h * d * layer.k.element_size()) // f * f)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        if kv is not None:
            k, v = kv[0][:, :, start:start + n].contiguous(), kv[1][:, :, start:start + n].contiguous()
        else:
            k = torch.randn(b, h, n, d, device=dev, dtype=dtype, generator=gen)
            v = torch.randn(b, h, n, dv, device=dev, dtype=dtype, generator=gen)
        seen, flushed = layer.host_counts()
        layer._commit_host(k, v, torch.ones(b, n, dtype=torch.bool, device=dev),
                           torch.arange(seen, seen + n, device=dev), seen, flushed)


def dense_attention(query, key, value, mask, scaling):
    """The backend attention a static layer hands one dense region when its read kernels are the references (the
    CPU), in the transformers adapter's layout: ``[B, q_len, Hq, Dv]``."""
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


def static_read(layer, query: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode step's attention read of a static layer (``query [B, Hq, 1, d]``): ``StaticLayer._read``, what
    ``StaticLayer._decode`` calls after writing the step's token.  ``[B, 1, Hq, Dv]``."""
    return layer._read(query, scale, dense_attention, None)[0]


def static_segments(layer) -> list:
    """The segments :func:`static_read` reads (as ``StaticLayer._read`` lists them; for the byte count)."""
    from kvcompress.state import Segment

    middle = layer.middle.segments() if layer.middle is not None else []
    length = None if middle else (layer.seen + layer.sink_slots).clamp(max=layer.sink_slots + layer.ring_slots)
    return [Segment(layer.k, layer.v, layer.valid, layer._zero_pos, length=length)] + middle


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _live_columns(valid: torch.Tensor | None, length: torch.Tensor | None, columns: int) -> int:
    """Token columns a read must scan: up to the last column valid in any row, and before ``length``."""
    live = columns
    if valid is not None:
        any_row = valid.any(0)
        live = int(any_row.nonzero().max()) + 1 if bool(any_row.any()) else 0
    if length is not None:
        live = min(live, int(length))
    return live


def segment_bytes(seg, kv_heads: int) -> int:
    """Bytes a kernel must read for one segment: K / V (or a KIVI region's codes, scales and zero points) over its
    live columns, the valid mask once per kv head, the channel list."""
    heads = kv_heads if seg.heads is None else seg.heads.numel()
    packed = seg.packed
    lanes = getattr(packed, "lanes", None)
    if lanes is not None:  # KIVI lanes read as one region (PackedLanes): every lane's payload, channel lists
        cols = packed.valid.shape[-1]
        live = _live_columns(packed.valid, packed.length, cols)
        payload = sum(_nbytes(*(getattr(lane, n) for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale",
                                                          "v_zero"))) for lane in lanes)
        return (payload * live // max(1, cols) + packed.valid.shape[0] * live * heads
                + sum(_nbytes(lane.channels, lane.heads) for lane in lanes))
    if packed is not None:
        if not hasattr(packed, "k_codes"):
            raise TypeError(f"no byte count for a {type(packed).__name__} region")
        cols = packed.valid.shape[-1]
        live = _live_columns(packed.valid, packed.length, cols)
        payload = _nbytes(packed.k_codes, packed.k_scale, packed.k_zero, packed.v_codes, packed.v_scale,
                          packed.v_zero)
        return payload * live // max(1, cols) + packed.valid.shape[0] * live * heads
    cols = seg.k.shape[2]
    live = _live_columns(seg.valid, seg.length, cols)
    n = _nbytes(seg.k, seg.v) * live // max(1, cols) + _nbytes(seg.channels)
    return n + (0 if seg.valid is None else seg.valid.shape[0] * live * heads)


def static_read_bytes(layer, query: torch.Tensor) -> int:
    """Bytes one :func:`static_read` must read: every segment (:func:`segment_bytes`) and the query."""
    return _nbytes(query) + sum(segment_bytes(s, layer.k.shape[1]) for s in static_segments(layer))


def static_impl(layer) -> str:
    """The read kernels a static layer chose: the lanes op, then each KIVI lane's (``kivi-lanes:``: every KIVI lane
    in one op, ``kvcompress::kivi_lanes_partial``)."""
    packed = [s.packed for s in static_segments(layer)[1:] if s.packed is not None]
    kivi = [p.impl for p in packed if not hasattr(p, "lanes")]
    merged = [p.impl for p in packed if hasattr(p, "lanes")]
    lanes = f"lanes:{layer.kernels['lanes_partial']}"
    if merged:
        lanes += f" + kivi-lanes:{','.join(dict.fromkeys(str(i) for i in merged))}"
    return lanes + (f" + kivi:{','.join(dict.fromkeys(str(i) for i in kivi))}" if kivi else "")


def _copy(obj):
    """An independent copy of a built input (its own device buffers): a static layer shares its pipeline (the
    compressor objects), nothing else."""
    pipeline = getattr(obj, "pipeline", None)
    return copy.deepcopy(obj, {id(pipeline): pipeline} if pipeline is not None else {})


def _result(op: str, shape: Shape, batch: int, ctx: int, timing: Timing | None, nbytes: int, **extra) -> dict:
    row = {"op": op, "model": shape.model, "batch": batch, "ctx": ctx, "q_heads": shape.q_heads,
           "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "bytes": int(nbytes)}
    if timing is not None:
        tbps = nbytes / timing.seconds / 1e12
        row.update(latency_us=timing.us, bandwidth_tbps=tbps, pct_of_peak=100 * tbps / PEAK_TBPS,
                   pct_of_4p3=100 * tbps / PEAK_TBPS, method=timing.method, calls=timing.calls, reps=timing.reps,
                   spread=timing.spread)
    row.update(extra)
    return row


_START = time.monotonic()


def _log(msg: str) -> None:
    print(f"[benchutil {time.monotonic() - _START:7.1f} s] {msg}", file=sys.stderr, flush=True)


def ctx_label(ctx: int) -> str:
    """``32768`` -> ``"32k"`` (tokens when not a multiple of 1024)."""
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def _describe(row: dict) -> str:
    where = f"{row_op(row)} {row['model']} B{row['batch']} {ctx_label(row['ctx'])}"
    if "latency_us" in row:
        vs = row.get("speedup_vs_sdpa")
        return (f"{where}: {row['latency_us']:.1f} us, {row['bandwidth_tbps']:.2f} TB/s "
                f"({row['pct_of_peak']:.0f}% of {PEAK_TBPS:g})" + (f", {vs:.2f}x SDPA" if vs else "")
                + (f" [{row['impl']}]" if row.get("impl") else ""))
    return f"{where}: " + (f"skipped ({row['skipped']})" if "skipped" in row else f"ERROR {row.get('error')}")


@dataclasses.dataclass
class _Case:
    """One (head shape, batch, context) of the grid and the rows it produced."""

    shape: Shape
    batch: int
    ctx: int
    device: torch.device
    ops: tuple
    rows: list
    gen: torch.Generator
    base: dict = dataclasses.field(default_factory=dict)  # op -> seconds (the baselines: sdpa, dense-ref)
    dtype: torch.dtype = torch.float16  # the model's dtype: queries and full-precision K / V

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def m(self) -> int:
        return self.shape.q_heads // self.shape.kv_heads

    @property
    def scale(self) -> float:
        return self.shape.head_dim ** -0.5

    @property
    def reps(self) -> int:
        return 20 if self.cuda else 5

    @property
    def dense_bytes(self) -> int:
        """The uncompressed cache's K and V, and the query (what SDPA reads; fp16 and bf16 alike: 2 bytes)."""
        s = self.shape
        return 2 * self.batch * s.kv_heads * self.ctx * s.head_dim * 2 + self.batch * s.q_heads * s.head_dim * 2

    def free(self) -> float:
        """Device bytes an op may allocate now (85 % of what is free, after releasing cached blocks).  No
        ``gc.collect()`` here (a third of a second with torch and Triton loaded): inputs are freed by reference
        counting when an op's function returns; :func:`_run_ops` collects after an exception."""
        if self.cuda:
            torch.cuda.empty_cache()
        return _free_bytes(self.device) * 0.85

    def emit(self, op: str, timing: Timing | None, nbytes: int, **extra) -> dict:
        if timing is not None and "sdpa" in self.base:
            extra.setdefault("speedup_vs_sdpa", self.base["sdpa"] / timing.seconds)
        if self.dtype != torch.float16:
            extra.setdefault("dtype", str(self.dtype).removeprefix("torch."))
        row = _result(op, self.shape, self.batch, self.ctx, timing, nbytes, **extra)
        self.rows.append(row)
        _log(_describe(row))
        return row

    def skip(self, op: str, est: int, why: str = "does not fit in device memory") -> None:
        self.emit(op, None, est, skipped=f"{why} (needs ~{est / 2**30:.1f} GiB)")

    def copies(self, op: str, est: int) -> int:
        """Input copies to rotate over for an op reading ``est`` bytes per call (a cold L2, within free memory), or
        0 after recording ``op`` as skipped when one copy does not fit."""
        free = self.free()
        if est > free:
            self.skip(op, est)
            return 0
        return min(copies_for(est), max(1, int(free // max(est, 1))))


def _error_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:400]}"


def _run_ops(c: _Case, names: Sequence[str], fn: Callable[[_Case], None]) -> None:
    """``fn(c)`` for the ops ``names`` (those of ``c.ops``); an exception (out of memory included) becomes an
    ``error`` row for each of them that has no row yet, and the run goes on.  Device memory is released after."""
    if not any(n in c.ops for n in names):
        return
    first = len(c.rows)
    failed = False
    try:
        fn(c)
    except Exception as exc:  # noqa: BLE001 - one op failing at one shape must not end the run
        failed = True
        text = _error_text(exc)
        done = {r["op"] for r in c.rows[first:]}
        for name in names:
            if name in c.ops and name not in done:
                c.emit(name, None, 0, error=text)
    if failed:  # the exception's frames held the op's inputs: release them before the next op allocates
        gc.collect()
    if c.cuda:
        torch.cuda.empty_cache()


def _attempt(c: _Case, name: str, fn: Callable[[], None]) -> None:
    """One op of a group sharing inputs: its exception becomes its ``error`` row, the group goes on."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        c.emit(name, None, 0, error=_error_text(exc))
    else:
        return
    gc.collect()
    if c.cuda:
        torch.cuda.empty_cache()


def _bench_built(c: _Case, name: str, est: int, build: Callable[[], tuple], read: Callable,
                 info: Callable[[Any, Any], tuple], query: Callable[[], torch.Tensor]) -> None:
    """Row ``name`` of an op whose input the stores build themselves: skipped when the estimate ``est`` (bytes, made
    before allocating) does not fit; else one input ``build() -> (query, obj)``, ``info(query, obj) -> (bytes read,
    bytes allocated, impl)``, copies of ``obj`` (deep copies: their own buffers) until the rotation streams
    :data:`ROTATE_BYTES` on CUDA, and ``read(query, obj)`` timed over them."""
    if est > c.free():
        c.skip(name, est)
        return
    q0, obj = build()
    nbytes, alloc, impl = info(q0, obj)
    data = [(q0, obj)]
    if c.cuda:
        n = min(copies_for(nbytes), MAX_COPIES, 1 + int(c.free() // max(1, alloc)))
        data += [(query(), _copy(obj)) for _ in range(n - 1)]
    t = time_op(read, data, reps=c.reps)
    c.emit(name, t, nbytes, impl=impl, bytes_vs_fp16=c.dense_bytes / nbytes)


# -- the ops, one function per group of rows sharing inputs ---------------------------------------------------------


def _bench_dense(c: _Case) -> None:
    """``sdpa`` (the baseline) and ``dense-ref`` on the uncompressed fp16 cache."""
    from .attention.reference import partial_attention

    dense_bytes, free = c.dense_bytes, c.free()
    n = copies_for(dense_bytes) if c.cuda else 1
    if dense_bytes * n > free:
        n = 1
    if dense_bytes * n > free:
        for name in ("sdpa", "dense-ref"):
            if name in c.ops:
                c.skip(name, dense_bytes)
        return
    s = c.shape
    data = [dense_inputs(c.batch, s.kv_heads, c.ctx, s.head_dim, c.m, c.device, c.gen, c.dtype) for _ in range(n)]
    if "sdpa" in c.ops:
        best, errors = None, []
        backends = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION") if c.cuda else (None,)
        for be in backends:
            try:
                t = time_op(_sdpa_fn(be), data, reps=c.reps)
            except RuntimeError as exc:
                errors.append(f"{be}: {_error_text(exc)[:120]}")
                continue
            if best is None or t.seconds < best[1].seconds:
                best = (be or "default", t)
        if best is not None:
            c.base["sdpa"] = best[1].seconds
            c.emit("sdpa", best[1], dense_bytes, backend=best[0])
        else:
            c.emit("sdpa", None, dense_bytes, error="; ".join(errors) or "no SDPA backend ran")
    if "dense-ref" in c.ops:
        if dense_bytes * 6 < free:  # fp32 upcasts of K and V plus scores

            def ref() -> None:
                t = time_op(lambda q, k, v: partial_attention(q, k, v, None, c.scale), data[:max(1, min(n, 4))],
                            reps=max(3, c.reps // 4))
                c.base["dense-ref"] = t.seconds
                c.emit("dense-ref", t, dense_bytes)

            _attempt(c, "dense-ref", ref)
        else:
            c.skip("dense-ref", dense_bytes * 6)


def _bench_kivi(c: _Case, bits: int) -> None:
    """``kivi{bits}`` (what the compressor runs), ``-triton`` (the Triton kernel), ``-ref`` (the reference)."""
    from .kivi import reference as kivi_ref

    name = f"kivi{bits}"
    s, m = c.shape, c.m
    q0, p0 = kivi_inputs(1, 1, KEY_GROUP, s.head_dim, bits, KEY_GROUP, VALUE_GROUP, m, c.device, c.gen, c.dtype)
    per_token = kivi_bytes(q0, p0) / KEY_GROUP  # ~bytes per token per (batch, kv head)
    est = int(per_token * KEY_GROUP * (c.ctx // KEY_GROUP) * c.batch * s.kv_heads)
    free = c.free()
    if est > free:
        for op in (name, name + "-ref", name + "-triton"):
            if op in c.ops and (c.cuda or op.endswith("-ref")):
                c.skip(op, est)
        return
    n = copies_for(est) if c.cuda else 1
    if est * n > free:
        n = max(1, int(free // max(est, 1)))
    data = [kivi_inputs(c.batch, s.kv_heads, c.ctx, s.head_dim, bits, KEY_GROUP, VALUE_GROUP, m, c.device, c.gen,
                        c.dtype) for _ in range(n)]
    nbytes = kivi_bytes(*data[0])
    ref_t = None
    if name + "-ref" in c.ops and est * 16 * 3 < free and c.batch * c.ctx <= 16 * 32768:

        def ref() -> None:
            nonlocal ref_t
            ref_t = time_op(lambda q, p: kivi_ref.kivi_attention_partial(q, p, c.scale), data[:max(1, min(n, 2))],
                            reps=max(3, c.reps // 4))
            c.emit(name + "-ref", ref_t, nbytes)

        _attempt(c, name + "-ref", ref)
    # ``kivi2`` / ``kivi4``: what the KIVI compressor runs (the dispatcher: CUDA v3 when nvcc is there, else Triton
    # v2), named in the row's ``impl``; ``kivi2-triton`` / ``kivi4-triton``: the Triton kernel itself
    timed = []
    if c.cuda:  # GPU kernels only: no Triton import on a CPU run
        from . import kivi as kivi_ops
        from .kivi import triton_kernel as kivi_triton

        timed = [(name, kivi_ops.kivi_attention_partial, lambda: kivi_ops.implementation(*data[0])),
                 (name + "-triton", kivi_triton.kivi_attention_partial, lambda: "triton-v2")]
    for op_name, fn, impl in timed:
        if op_name not in c.ops:
            continue

        def one(op_name=op_name, fn=fn, impl=impl) -> None:
            t = time_op(lambda q, p: fn(q, p, c.scale), data, reps=c.reps)
            c.emit(op_name, t, nbytes, impl=impl(),
                   speedup_vs_ref=ref_t.seconds / t.seconds if ref_t is not None else None,
                   bytes_vs_fp16=c.dense_bytes / nbytes)

        _attempt(c, op_name, one)


def _bench_leank(c: _Case, ratio: int) -> None:
    """``leank{ratio}``: the grouped Triton kernel; the middle is ``ctx - 1024`` tokens, pruned per LEANK_COUNTS."""
    name = f"leank{ratio}"
    if not c.cuda or c.ctx <= LEANK_FP_TOKENS:
        return
    s = c.shape
    n = c.copies(name, int(c.dense_bytes * 0.8))
    if not n:
        return
    data = [leank_inputs(c.batch, s.kv_heads, c.ctx - LEANK_FP_TOKENS, s.head_dim, c.m, ratio, c.device, c.gen,
                         dtype=c.dtype) for _ in range(n)]
    nbytes = leank_bytes(*data[0])
    from .leank.triton_kernel import grouped_partial_attention as grouped

    t = time_op(lambda q, lanes: grouped(q, lanes, c.scale), data, reps=c.reps)
    c.emit(name, t, nbytes, bytes_vs_fp16=c.dense_bytes / nbytes)


def _bench_doublesparse(c: _Case, frac: int, shared: bool, fused: bool = False) -> None:
    """``ds8`` / ``ds16`` (``-shared``: group-shared selection): fused label scores + top-k (16 fp16 label channels;
    ctx/8 or ctx/16 tokens per query head, or per kv head) + gather attention, or the two in one kernel where a
    model's read takes it (``fuse_gather`` in ``KVCOMPRESS_DS_CONFIG``, else its rule ``fuse_rule``); ``-fused``:
    always the one kernel (``select_gather_partial``) where it runs."""
    from .doublesparse.bench import ds_decode, ds_inputs, ds_read_bytes

    name = f"ds{frac}" + ("-shared" if shared else "") + ("-fused" if fused else "")
    if not c.cuda:
        return
    s = c.shape
    n = c.copies(name, int(c.dense_bytes * 1.2))
    if not n:
        return
    data = [ds_inputs(c.batch, s.q_heads, s.kv_heads, c.ctx, s.head_dim, 16, 16, c.device, c.gen, dtype=c.dtype)
            for _ in range(n)]
    kk = c.ctx // frac
    t = time_op(lambda q, lab, ch, k, v: ds_decode(q, lab, ch, k, v, kk, c.scale, shared=shared,
                                                   fused=True if fused else None), data, reps=c.reps)
    nbytes = ds_read_bytes(data[0][0], data[0][1], data[0][3], kk, shared=shared)
    c.emit(name, t, nbytes, k=kk, bytes_vs_fp16=c.dense_bytes / nbytes)


def _kivi_region_bytes(tokens: int, heads: int, head_dim: int, bits: int = 2) -> int:
    """Codes, scales and zero points of ``tokens`` KIVI tokens of ``heads`` heads (every channel), with the mask."""
    from .kivi.reference import packed_bytes

    return packed_bytes(tokens, heads, head_dim, head_dim, bits, KEY_GROUP, VALUE_GROUP) + tokens


def _fill_transient(c: _Case, chunk_bytes: int) -> int:
    """Transient bytes of filling a layer or pool chunk by chunk (the chunk's K / V, copies and encoder scratch)."""
    s = c.shape
    return 8 * min(chunk_bytes, c.batch * s.kv_heads * c.ctx * s.head_dim * 2)


def _static_estimate(c: _Case, op: str) -> int:
    """Device bytes :func:`build_static_layer` allocates for ``op`` at this shape, plus the fill's transients."""
    s, b = c.shape, c.batch
    cap = c.ctx + CAPACITY_SLACK
    transient = _fill_transient(c, FILL_CHUNK_BYTES)
    if op == "none":
        return 2 * b * s.kv_heads * cap * s.head_dim * 2 + b * cap + transient
    window = (REGIONS["flush"] + KEY_GROUP if op == "kivi2-static"
              else REGIONS["sinks"] + REGIONS["window"] + 2 * REGIONS["flush"])
    buffer = 2 * b * s.kv_heads * window * s.head_dim * 2 + b * window
    if op == "kivi2-static":
        return buffer + b * _kivi_region_bytes(cap, s.kv_heads, s.head_dim) + transient
    if op in ("leank70-kivi2", "leank70-kivi2-perlane", "leank70-kivi2-triton"):  # bounded by KIVI-2, all channels
        return buffer + b * _kivi_region_bytes(cap, s.kv_heads, s.head_dim) + transient
    return buffer + b * s.kv_heads * cap * (s.head_dim // 2 + s.head_dim) * 2 + b * cap * 9 + transient


def _bench_static(c: _Case, op: str) -> None:
    """``none`` / ``leank70-kivi2`` / ``lowrank``: a static layer's decode read (:func:`static_read`)."""
    s = c.shape

    def query() -> torch.Tensor:
        return torch.randn(c.batch, s.q_heads, 1, s.head_dim, device=c.device, dtype=c.dtype, generator=c.gen)

    def build():
        return query(), build_static_layer(op, s, c.batch, c.ctx, c.device, c.gen, dtype=c.dtype)

    def info(q, layer):
        return static_read_bytes(layer, q), sum(layer.memory().values()), static_impl(layer)

    _bench_built(c, op, _static_estimate(c, op), build, lambda q, layer: static_read(layer, q, c.scale), info, query)


PAGED_OPS = ("paged-dense", "paged-kivi2", "paged-kivi2-gather")


def _bench_paged(c: _Case, op: str) -> None:
    """``paged-dense`` / ``paged-kivi2-gather``: the dynamic pool's lane (``PagedView.attention_partial``);
    ``paged-kivi2``: the static pool's KIVI region read in place (``PackedKV.attention_partial``)."""
    from .paged import bench as paged_bench

    s = c.shape

    def query() -> torch.Tensor:
        return torch.randn(c.batch, s.kv_heads, c.m, s.head_dim, device=c.device, dtype=c.dtype, generator=c.gen)

    transient = _fill_transient(c, paged_bench.FILL_CHUNK_BYTES)
    kivi = c.batch * _kivi_region_bytes(c.ctx + 64, s.kv_heads, s.head_dim) + transient
    if op == "paged-dense":
        est = int(c.dense_bytes * 2.3) + transient  # the pool grows by a quarter: old + new buffers at the last growth

        def build():
            return query(), paged_bench.paged_pool(c.batch, s.kv_heads, c.ctx, s.head_dim, c.device, c.gen,
                                                   dtype=c.dtype)[1]

        def info(q, view):
            impl = "triton" if _paged_uses_triton(q, view) else "reference"
            return paged_bench.pool_bytes(q, view), sum(view.store.nbytes().values()), impl

        def read(q, view):
            return view.attention_partial(q, c.scale)
    elif op == "paged-kivi2-gather":
        est = 3 * kivi + 4 * transient  # the pool (+ a quarter growing), the gathered region, the reference encoder

        def build():
            codec = paged_bench.kivi_codec(s.head_dim)
            return query(), paged_bench.paged_pool(c.batch, s.kv_heads, c.ctx, s.head_dim, c.device, c.gen, page=32,
                                                   codec=codec, dtype=c.dtype)[1]

        def info(q, view):
            from .kivi import implementation

            return (paged_bench.pool_bytes(q, view), sum(view.store.nbytes().values()),
                    "gather + " + implementation(q, view.region()))

        def read(q, view):
            return view.attention_partial(q, c.scale)
    else:
        est = kivi

        def build():
            return query(), paged_bench.static_kivi_pool(c.batch, s.kv_heads, c.ctx, s.head_dim, c.device, c.gen,
                                                         dtype=c.dtype)[1]

        def info(q, packed):
            alloc = _nbytes(packed.k_codes, packed.k_scale, packed.k_zero, packed.v_codes, packed.v_scale,
                            packed.v_zero, packed.valid)
            return _nbytes(q) + segment_bytes(_segment_of(packed), s.kv_heads), alloc, f"kivi:{packed.impl}"

        def read(q, packed):
            return packed.attention_partial(q, c.scale)
    _bench_built(c, op, est, build, read, info, query)


def _paged_uses_triton(query: torch.Tensor, view) -> bool:
    """Whether the paged dispatcher (``kernels.paged.paged_attention_partial`` without ``impl``) takes the Triton
    kernel for this read."""
    from .ops import triton_available
    from .paged import triton_supported

    return triton_supported(query, view.payload["k"]) and triton_available()


def _segment_of(packed):
    from kvcompress.state import Segment

    return Segment(None, None, packed.valid, torch.zeros((), dtype=torch.long), packed=packed)


def _op_groups() -> list[tuple[tuple[str, ...], Callable[[_Case], None]]]:
    """``(op names, function)`` in run order (the baselines first)."""
    groups: list = [(("sdpa", "dense-ref"), _bench_dense)]
    for bits in (2, 4):
        groups.append(((f"kivi{bits}", f"kivi{bits}-ref", f"kivi{bits}-triton"), functools.partial(_bench_kivi,
                                                                                                 bits=bits)))
    for ratio in (50, 70):
        groups.append(((f"leank{ratio}",), functools.partial(_bench_leank, ratio=ratio)))
    for frac, shared in ((8, False), (16, False), (8, True), (16, True)):
        for fused in (False, True):
            groups.append(((f"ds{frac}" + ("-shared" if shared else "") + ("-fused" if fused else ""),),
                           functools.partial(_bench_doublesparse, frac=frac, shared=shared, fused=fused)))
    for op in STATIC_OPS:
        groups.append(((op,), functools.partial(_bench_static, op=op)))
    for op in PAGED_OPS:
        groups.append(((op,), functools.partial(_bench_paged, op=op)))
    return groups


ALL_OPS = ("sdpa", "dense-ref", "kivi2", "kivi4", "kivi2-ref", "kivi4-ref", "kivi2-triton", "kivi4-triton",
           "leank50", "leank70", "ds8", "ds16", "ds8-shared", "ds16-shared", "none", "kivi2-static", "leank70-kivi2",
           "lowrank", "paged-dense", "paged-kivi2")
#: ops that run only when named in ``--ops``
EXTRA_OPS = ("paged-kivi2-gather", "leank70-kivi2-perlane", "leank70-kivi2-triton", "ds8-fused", "ds16-fused",
             "ds8-shared-fused", "ds16-shared-fused")
#: the ops of issue 19's grid (``--ops`` default minus the references and the Triton KIVI rows)
GRID_OPS = ("sdpa", "kivi2", "kivi4", "leank50", "leank70", "leank70-kivi2", "ds8", "ds16", "ds8-shared",
            "ds16-shared", "paged-dense", "paged-kivi2", "lowrank", "none", "kivi2-static")


def _bench_case(shape: Shape, batch: int, ctx: int, device: torch.device, rows: list[dict],
                ops: Sequence[str], dtype: torch.dtype = torch.float16) -> None:
    gen = torch.Generator(device=device).manual_seed(batch * 7919 + ctx)
    c = _Case(shape, batch, ctx, device, tuple(ops), rows, gen, dtype=dtype)
    for names, fn in _op_groups():
        _run_ops(c, names, fn)
    if "dense-ref" in c.base and "sdpa" in c.base:
        for row in c.rows:
            if row["op"] == "dense-ref" and row["model"] == shape.model and row["batch"] == batch and \
                    row["ctx"] == ctx and "latency_us" in row:
                row["speedup_vs_sdpa"] = c.base["sdpa"] / (row["latency_us"] * 1e-6)


def row_op(row: dict) -> str:
    """A row's op as tables name it: ``kivi2``, or ``kivi2@bf16`` for a row of bf16 data (``--dtype bfloat16``), so
    that no table or matrix mixes its cells with the float16 grid's."""
    return row["op"] + ("@bf16" if row.get("dtype") == "bfloat16" else "")


def markdown_table(rows: Sequence[dict]) -> str:
    head = ("| op | model | B | ctx | latency (µs) | bytes read (MB) | TB/s | % of 4.3 TB/s | vs SDPA "
            "| vs reference |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]

    def f(x, fmt):
        return format(x, fmt) + "x" if isinstance(x, (int, float)) else "n/a"

    for r in rows:
        name = row_op(r)
        if "latency_us" not in r:
            why = r.get("skipped") or ("error: " + str(r.get("error", "n/a"))[:80])
            lines.append(f"| {name} | {r['model']} | {r['batch']} | {ctx_label(r['ctx'])} | {why} "
                         f"| {r['bytes'] / 1e6:.0f} | | | | |")
            continue
        op = f"{name} ({r['impl']})" if r.get("impl") and not r["op"].endswith("-triton") else name
        pct = r.get("pct_of_peak", r.get("pct_of_4p3"))
        lines.append(
            f"| {op} | {r['model']} | {r['batch']} | {ctx_label(r['ctx'])} | {r['latency_us']:.1f} | "
            f"{r['bytes'] / 1e6:.1f} | {r['bandwidth_tbps']:.2f} | {pct:.0f}% | "
            f"{f(r.get('speedup_vs_sdpa'), '.2f')} | {f(r.get('speedup_vs_ref'), '.1f')} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the grid and the run


def parse_context(text: str | int) -> int:
    """``"32k"`` -> 32768, ``"4096"`` -> 4096."""
    t = str(text).strip().lower()
    return int(t[:-1]) * 1024 if t.endswith("k") else int(t)


def _shape_named(name: str | Shape, shapes: Sequence[Shape] = SHAPES) -> Shape:
    if isinstance(name, Shape):
        return name
    for s in shapes:
        if s.model == name:
            return s
    raise ValueError(f"unknown model {name!r}; one of {[s.model for s in shapes]}")


def grid(device: str | torch.device = "cuda", *, quick: bool = False, models: Sequence[str | Shape] | None = None,
         batches: Sequence[int] | None = None, contexts: Sequence[int] | None = None,
         only: Sequence[tuple] | None = None) -> list[tuple[Shape, int, int]]:
    """The ``(head shape, batch, ctx)`` cases of a run, in order.

    ``only``: exactly these ``(model, batch, ctx)``.  Otherwise the full grid (:data:`SHAPES` x :data:`BATCHES` x
    :data:`CONTEXTS`; on the CPU :data:`CPU_BATCHES` x :data:`CPU_CONTEXTS`), or :data:`QUICK` with ``quick``,
    restricted to ``models`` (names, or :class:`Shape` objects, which may be other head shapes), ``batches`` and
    ``contexts`` when given."""
    if only:
        return [(_shape_named(m), int(b), parse_context(t)) for m, b, t in only]
    shapes = [_shape_named(m) for m in models] if models else list(SHAPES)
    cuda = torch.device(device).type == "cuda"
    if quick:
        cases = [(s, b, t) for s, b, t in QUICK if s in shapes or not models]
        return [(s, b, t) for s, b, t in cases if (not batches or b in batches) and (not contexts or t in contexts)]
    bs = tuple(batches) if batches else (BATCHES if cuda else CPU_BATCHES)
    ts = tuple(contexts) if contexts else (CONTEXTS if cuda else CPU_CONTEXTS)
    return [(s, b, t) for s in shapes for b in bs for t in ts]


def _key(shape: Shape, batch: int, ctx: int) -> list:
    return [shape.model, int(batch), int(ctx)]


def _conditions(dev: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(dev), "torch": torch.__version__,
                            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        # the caching allocator's settings moved same-kernel reads of large caches by up to 19 % (docs/results.md,
        # session 39: expandable segments), so every result says which it ran under
        info["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return info


def _write(out: str, doc: dict) -> None:
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=1)
    os.replace(tmp, out)


def run_kernel_benchmarks(device: str | None = None, out: str | None = None, *, quick: bool = False,
                          ops: Sequence[str] = ALL_OPS, models: Sequence[str | Shape] | None = None,
                          batches: Sequence[int] | None = None, contexts: Sequence[int] | None = None,
                          only: Sequence[tuple] | None = None, resume: bool = False,
                          max_seconds: float | None = None, dtype: torch.dtype = torch.float16) -> list[dict]:
    """Benchmark the ops of ``kvcompress.kernels`` over the grid; print a markdown table, write JSON to ``out``.

    Args:
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"`` (default: CUDA when available).
        out: path of a JSON file for the rows (with the conditions: device name, versions, date), rewritten after
            every shape with the shapes ``done`` and the shapes ``remaining``.
        quick, models, batches, contexts, only: the cases (:func:`grid`).
        ops: which ops to time (:data:`ALL_OPS`, :data:`EXTRA_OPS`).
        resume: first read ``out`` (when it exists) and keep its rows of the shapes it has done, skipping them.
        max_seconds: start no shape after this many seconds (the rest is listed as ``remaining``).
        dtype: the model dtype of the data (float16 or bfloat16): queries and full-precision K / V (KIVI scales
            and zero points are fp16 in either, as the stores hold them); rows of bf16 data carry ``dtype``.

    Returns:
        One dict per (op, shape): latency, bytes read, bandwidth, % of peak, speed-ups (see the module docstring).
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype: expected torch.float16 or torch.bfloat16, got {dtype}")
    unknown = set(ops) - set(ALL_OPS) - set(EXTRA_OPS)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; known: {', '.join(ALL_OPS + EXTRA_OPS)}")
    cases = grid(dev, quick=quick, models=models, batches=batches, contexts=contexts, only=only)
    rows: list[dict] = []
    done: list[list] = []
    if resume and out and os.path.exists(out):
        with open(out) as fh:
            old = json.load(fh)
        old_dtype = old.get("conditions", {}).get("dtype", "float16")
        if old_dtype != str(dtype).removeprefix("torch."):
            raise ValueError(f"resume: {out} holds {old_dtype} rows, this run is {dtype}: give another --out")
        done = [list(k) for k in old.get("done", [])]
        rows = [r for r in old.get("rows", []) if [r["model"], r["batch"], r["ctx"]] in done]
        _log(f"resuming {out}: {len(done)} shapes done, {len(rows)} rows kept")
    start = time.monotonic()
    doc: dict[str, Any] = {"conditions": {**_conditions(dev), "dtype": str(dtype).removeprefix("torch.")},
                           "ops": list(ops), "done": done, "remaining": [], "rows": rows}
    todo = [case for case in cases if _key(*case) not in done]
    if dev.type == "cuda" and "expandable_segments:true" not in doc["conditions"]["PYTORCH_CUDA_ALLOC_CONF"].lower():
        _log("PyTorch's default caching allocator: large-pool reads after other ops' allocations can be up to ~19% "
             "slower than the same read in a fresh process (docs/results.md, session 39); for comparable rows of "
             "caches of tens of GB run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (small caches read up "
             "to a few % slower under it, session 40)")
    for i, (shape, batch, ctx) in enumerate(todo):
        if max_seconds is not None and time.monotonic() - start > max_seconds:
            _log(f"time limit ({max_seconds:.0f} s): {len(todo) - i} shapes left")
            break
        _log(f"shape {i + 1}/{len(todo)}: {shape.model} B{batch} {ctx_label(ctx)}")
        _bench_case(shape, batch, ctx, dev, rows, ops, dtype)
        done.append(_key(shape, batch, ctx))
        doc["remaining"] = [_key(*case) for case in todo[i + 1:]]
        if out:
            _write(out, doc)
    doc["remaining"] = [_key(*case) for case in todo if _key(*case) not in done]
    if out:
        _write(out, doc)
    print(markdown_table(rows))
    return rows


def _ints(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",") if x.strip()] if text else None


def _only(text: str | None) -> list[tuple] | None:
    if not text:
        return None
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3:
            raise argparse.ArgumentTypeError(f"--only-shapes wants model:B:ctx items, got {item!r}")
        out.append((parts[0], int(parts[1]), parse_context(parts[2])))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="JSON file, rewritten after every shape")
    ap.add_argument("--quick", action="store_true", help="three shapes: Llama B1/32k, B16/32k, SmolLM2 B16/32k")
    ap.add_argument("--ops", default=",".join(ALL_OPS), help="comma-separated ops (default: all but the extras); "
                    "'grid': issue 19's ops (GRID_OPS); 'all': every op, the extras too")
    ap.add_argument("--list-ops", action="store_true", help="print the ops and exit")
    ap.add_argument("--models", default=None, help=f"comma-separated, of {','.join(s.model for s in SHAPES)}")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,4,16,64)")
    ap.add_argument("--contexts", default=None,
                    help="comma-separated contexts, 4k style or tokens (default 4k,32k,128k)")
    ap.add_argument("--only-shapes", default=None, help="exactly these shapes: model:B:ctx,... (e.g. llama3-8b:16:32k)")
    ap.add_argument("--resume", action="store_true", help="skip the shapes --out has done (keep its rows)")
    ap.add_argument("--max-seconds", type=float, default=None, help="start no shape after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="print the shapes and exit")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"),
                    help="the model dtype of the queries and full-precision K / V (default float16; KIVI scales "
                    "stay fp16, as the stores hold them; bf16 rows carry a dtype field and show as op@bf16)")
    args = ap.parse_args(argv)
    if args.list_ops:
        print("default:", ",".join(ALL_OPS))
        print("extra:", ",".join(EXTRA_OPS))
        print("issue 19 grid:", ",".join(GRID_OPS))
        return 0
    kw = dict(quick=args.quick, models=args.models.split(",") if args.models else None, batches=_ints(args.batches),
              contexts=[parse_context(x) for x in args.contexts.split(",")] if args.contexts else None,
              only=_only(args.only_shapes))
    if args.dry_run:
        dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        for shape, batch, ctx in grid(dev, **kw):
            print(f"{shape.model}:{batch}:{ctx_label(ctx)}")
        return 0
    ops = {"grid": GRID_OPS, "all": ALL_OPS + EXTRA_OPS}.get(args.ops) or tuple(o for o in args.ops.split(",") if o)
    run_kernel_benchmarks(args.device, args.out, ops=ops, resume=args.resume, max_seconds=args.max_seconds,
                          dtype=getattr(torch, args.dtype), **kw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
