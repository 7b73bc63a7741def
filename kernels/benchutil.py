"""Timing utilities and the per-kernel benchmark of every op in ``kvcompress.kernels``.

Timing (:func:`time_op`):

* **CUDA**: each timed call reads its own copy of the inputs, rotating over at least
  :data:`ROTATE_BYTES` (400 MB, several times the 60 MB L2 of an H200) so every call
  streams from HBM (a cold L2), as a decode step does.  The calls over all copies are
  captured in one CUDA graph (falling back to eager launches if capture fails), the
  graph is replayed ``reps`` times between CUDA events, and the median replay time
  divided by the number of calls is reported.
* **CPU**: wall clock (``time.perf_counter``) around single calls, median of ``reps``.

:func:`run_kernel_benchmarks` times, per shape (Llama-3-8B-like: 32 query / 8 kv heads,
d = 128; SmolLM2-135M: 9 / 3, d = 64; B in {1, 16, 64}, ctx in {4k, 32k, 128k} where the
data fits in device memory):

* ``kivi2`` / ``kivi4``: the KIVI partial attention the compressor runs (2 / 4 bits, key group 32, value
  group 32) over ``ctx`` packed tokens: ``kernels.kivi.kivi_attention_partial``, i.e. the CUDA kernel (v3) when
  nvcc is available, else the Triton kernel (v2); the row's ``impl`` names it.  ``kivi2-triton`` /
  ``kivi4-triton``: the Triton kernel (v2) itself;
* ``kivi2-ref`` / ``kivi4-ref``: its PyTorch reference (dequantize + einsum), small shapes only;
* ``dense-ref``: the dense partial attention reference over an fp16 cache;
* ``ds8`` / ``ds16`` (``-shared``): one DoubleSparse decode read (fused label scoring + exact top-k of
  ctx/8 or ctx/16 tokens per query head, or per kv head when shared, + gather attention);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on the same fp16 cache
  (GQA rows folded into the query length, so every backend applies), the baseline.

Each row has the median latency, the bytes the op reads (codes, scales, zero points and
the valid mask for KIVI; K and V for the dense ops; the query), the achieved bandwidth on
those bytes, and the speed-up over SDPA and over the op's reference at the same shape.

Run: ``python -m kvcompress.kernels.benchutil [--device cuda] [--out results.json]``
(or ``kvcompress bench --kernels``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from typing import Any, Callable, Sequence

import torch

ROTATE_BYTES = 400 * 1024**2
H200_BANDWIDTH = 4.3e12  # measured device-copy floor, bytes/s (see the project's performance notes)


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
BATCHES = (1, 16, 64)
CONTEXTS = (4096, 32768, 131072)
KEY_GROUP = 32
VALUE_GROUP = 32


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return 8 * 1024**3  # CPU runs use tiny shapes


def kivi_inputs(batch: int, kv_heads: int, tokens: int, head_dim: int, bits: int, group: int, v_group: int,
                m: int, device: torch.device, gen: torch.Generator | None = None):
    """Random packed KIVI data (all slots valid) and grouped queries; codes use every bit pattern."""
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
    q = torch.randn(batch, kv_heads, m, head_dim, device=device, dtype=torch.float16, generator=gen)
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
    for heads, channels, k, v, valid in lanes:
        n += k.numel() * k.element_size() + v.numel() * v.element_size()
        n += 0 if valid is None else valid.numel() * k.shape[1]
        n += 0 if channels is None else channels.numel() * channels.element_size()
    return n


def kivi_bytes(q: torch.Tensor, packed) -> int:
    """Bytes the KIVI kernel reads: codes, scales, zeros, the valid mask once per kv head, the query."""
    t = [packed.k_codes, packed.k_scale, packed.k_zero, packed.v_codes, packed.v_scale, packed.v_zero]
    heads = packed.k_codes.shape[1]
    return sum(x.numel() * x.element_size() for x in t) + packed.valid.numel() * heads + q.numel() * q.element_size()


def dense_inputs(batch: int, kv_heads: int, tokens: int, head_dim: int, m: int, device: torch.device,
                 gen: torch.Generator | None = None):
    k = torch.randn(batch, kv_heads, tokens, head_dim, device=device, dtype=torch.float16, generator=gen)
    v = torch.randn(batch, kv_heads, tokens, head_dim, device=device, dtype=torch.float16, generator=gen)
    q = torch.randn(batch, kv_heads, m, head_dim, device=device, dtype=torch.float16, generator=gen)
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


def _result(op: str, shape: Shape, batch: int, ctx: int, timing: Timing | None, nbytes: int, **extra) -> dict:
    row = {"op": op, "model": shape.model, "batch": batch, "ctx": ctx, "q_heads": shape.q_heads,
           "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "bytes": nbytes}
    if timing is not None:
        row.update(latency_us=timing.us, bandwidth_tbps=nbytes / timing.seconds / 1e12,
                   pct_of_4p3=100 * nbytes / timing.seconds / H200_BANDWIDTH, method=timing.method,
                   calls=timing.calls, reps=timing.reps, spread=timing.spread)
    row.update(extra)
    return row


def _cases(device: torch.device, quick: bool):
    if device.type != "cuda":
        # CPU: reference ops only, small shapes (the Triton kernel needs a GPU or the interpreter)
        return [(s, 1, 1024) for s in SHAPES]
    if quick:
        return [(SHAPES[0], 1, 32768), (SHAPES[0], 16, 32768), (SHAPES[1], 16, 32768)]
    return [(s, b, c) for s in SHAPES for b in BATCHES for c in CONTEXTS]


def _bench_case(shape: Shape, batch: int, ctx: int, device: torch.device, rows: list[dict],
                ops: Sequence[str]) -> None:
    from .attention.reference import partial_attention
    from .kivi import reference as kivi_ref

    gen = torch.Generator(device=device).manual_seed(batch * 7919 + ctx)
    m = shape.q_heads // shape.kv_heads
    scale = shape.head_dim ** -0.5
    free = _free_bytes(device) * 0.85
    reps = 20 if device.type == "cuda" else 5
    dense_bytes = 2 * batch * shape.kv_heads * ctx * shape.head_dim * 2 + batch * shape.q_heads * shape.head_dim * 2

    base: dict[str, float] = {}
    # ---- dense baselines (fp16 cache)
    if {"sdpa", "dense-ref"} & set(ops):
        n = copies_for(dense_bytes) if device.type == "cuda" else 1
        if dense_bytes * n > free:
            n = 1
        if dense_bytes * n <= free:
            data = [dense_inputs(batch, shape.kv_heads, ctx, shape.head_dim, m, device, gen) for _ in range(n)]
            if "sdpa" in ops:
                best = None
                backends = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION") if device.type == "cuda" \
                    else (None,)
                for be in backends:
                    try:
                        t = time_op(_sdpa_fn(be), data, reps=reps)
                    except RuntimeError:
                        continue
                    if best is None or t.seconds < best[1].seconds:
                        best = (be or "default", t)
                if best is not None:
                    base["sdpa"] = best[1].seconds
                    rows.append(_result("sdpa", shape, batch, ctx, best[1], dense_bytes, backend=best[0]))
            if "dense-ref" in ops and dense_bytes * 6 < free:  # fp32 upcasts of K and V plus scores
                t = time_op(lambda q, k, v: partial_attention(q, k, v, None, scale), data[:max(1, min(n, 4))],
                            reps=max(3, reps // 4))
                base["dense-ref"] = t.seconds
                rows.append(_result("dense-ref", shape, batch, ctx, t, dense_bytes))
            del data
    else:
        n = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # ---- KIVI (fused kernel and its reference)
    for bits in (2, 4):
        name = f"kivi{bits}"
        if not {name, name + "-ref", name + "-triton"} & set(ops):
            continue
        q0, p0 = kivi_inputs(1, 1, KEY_GROUP, shape.head_dim, bits, KEY_GROUP, VALUE_GROUP, m, device, gen)
        per_token = kivi_bytes(q0, p0) / KEY_GROUP  # ~bytes per token per (batch, kv head)
        est = int(per_token * KEY_GROUP * (ctx // KEY_GROUP) * batch * shape.kv_heads)
        n = copies_for(est) if device.type == "cuda" else 1
        if est * n > free:
            n = max(1, int(free // max(est, 1)))
        if est > free:
            rows.append(_result(name, shape, batch, ctx, None, est, skipped="does not fit in device memory"))
            continue
        data = [kivi_inputs(batch, shape.kv_heads, ctx, shape.head_dim, bits, KEY_GROUP, VALUE_GROUP, m, device, gen)
                for _ in range(n)]
        nbytes = kivi_bytes(*data[0])
        ref_t = None
        if name + "-ref" in ops and est * 16 * 3 < free and batch * ctx <= 16 * 32768:
            ref_t = time_op(lambda q, p: kivi_ref.kivi_attention_partial(q, p, scale), data[:max(1, min(n, 2))],
                            reps=max(3, reps // 4))
            rows.append(_result(name + "-ref", shape, batch, ctx, ref_t, nbytes,
                                speedup_vs_sdpa=base["sdpa"] / ref_t.seconds if "sdpa" in base else None))
        # ``kivi2`` / ``kivi4``: what the KIVI compressor runs (the dispatcher: CUDA v3 when nvcc is there, else
        # Triton v2), named in the row's ``impl``; ``kivi2-triton`` / ``kivi4-triton``: the Triton kernel itself
        timed = []
        if device.type == "cuda":  # GPU kernels only: no Triton import on a CPU run
            from . import kivi as kivi_ops
            from .kivi import triton_kernel as kivi_triton

            timed = [(name, kivi_ops.kivi_attention_partial, kivi_ops.implementation(*data[0])),
                     (name + "-triton", kivi_triton.kivi_attention_partial, "triton-v2")]
        for op_name, fn, impl in timed:
            if op_name not in ops:
                continue
            t = time_op(lambda q, p, fn=fn: fn(q, p, scale), data, reps=reps)
            rows.append(_result(
                op_name, shape, batch, ctx, t, nbytes, impl=impl,
                speedup_vs_sdpa=base["sdpa"] / t.seconds if "sdpa" in base else None,
                speedup_vs_ref=ref_t.seconds / t.seconds if ref_t is not None else None,
                bytes_vs_fp16=dense_bytes / nbytes))
        del data
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _bench_leank(shape, batch, ctx, device, rows, ops, base, dense_bytes, m, scale, free, reps, gen)
    _bench_doublesparse(shape, batch, ctx, device, rows, ops, base, dense_bytes, scale, free, reps, gen)
    for row in rows:
        if row["op"] == "dense-ref" and row["model"] == shape.model and row["batch"] == batch and \
                row["ctx"] == ctx and "sdpa" in base and "latency_us" in row:
            row["speedup_vs_sdpa"] = base["sdpa"] / (row["latency_us"] * 1e-6)


def _bench_leank(shape, batch, ctx, device, rows, ops, base, dense_bytes, m, scale, free, reps, gen) -> None:
    """LeanK rows: the grouped Triton kernel; the middle is ``ctx - 1024`` tokens, pruned per LEANK_COUNTS."""
    for ratio in (50, 70):
        name = f"leank{ratio}"
        if name not in ops or device.type != "cuda" or ctx <= LEANK_FP_TOKENS:
            continue
        middle = ctx - LEANK_FP_TOKENS
        est = int(dense_bytes * 0.8)
        n = copies_for(est)
        if est * n > free:
            n = max(1, int(free // max(est, 1)))
        if est > free:
            rows.append(_result(name, shape, batch, ctx, None, est, skipped="does not fit in device memory"))
            continue
        data = [leank_inputs(batch, shape.kv_heads, middle, shape.head_dim, m, ratio, device, gen) for _ in range(n)]
        nbytes = leank_bytes(*data[0])
        from .leank.triton_kernel import grouped_partial_attention as grouped

        t = time_op(lambda q, lanes: grouped(q, lanes, scale), data, reps=reps)
        rows.append(_result(name, shape, batch, ctx, t, nbytes,
                            speedup_vs_sdpa=base["sdpa"] / t.seconds if "sdpa" in base else None,
                            bytes_vs_fp16=dense_bytes / nbytes))
        del data
        torch.cuda.empty_cache()


def _bench_doublesparse(shape, batch, ctx, device, rows, ops, base, dense_bytes, scale, free, reps, gen) -> None:
    """DoubleSparse rows (``ds8`` / ``ds16``, ``-shared``: group-shared selection): fused label scores + top-k
    (16 fp16 label channels; ctx/8 or ctx/16 tokens per query head, or per kv head) + gather attention, vs SDPA
    on the full fp16 cache."""
    from .doublesparse.bench import ds_decode, ds_inputs, ds_read_bytes

    for frac, shared in ((8, False), (16, False), (8, True), (16, True)):
        name = f"ds{frac}" + ("-shared" if shared else "")
        if name not in ops or device.type != "cuda":
            continue
        est = int(dense_bytes * 1.2)
        n = min(copies_for(est), max(1, int(free // max(est, 1))))
        if est > free:
            rows.append(_result(name, shape, batch, ctx, None, est, skipped="does not fit in device memory"))
            continue
        data = [ds_inputs(batch, shape.q_heads, shape.kv_heads, ctx, shape.head_dim, 16, 16, device, gen)
                for _ in range(n)]
        kk = ctx // frac
        t = time_op(lambda q, lab, ch, k, v: ds_decode(q, lab, ch, k, v, kk, scale, shared=shared), data, reps=reps)
        nbytes = ds_read_bytes(data[0][0], data[0][1], data[0][3], kk, shared=shared)
        rows.append(_result(name, shape, batch, ctx, t, nbytes, k=kk,
                            speedup_vs_sdpa=base["sdpa"] / t.seconds if "sdpa" in base else None,
                            bytes_vs_fp16=dense_bytes / nbytes))
        del data
        torch.cuda.empty_cache()


ALL_OPS = ("sdpa", "dense-ref", "kivi2", "kivi4", "kivi2-ref", "kivi4-ref", "kivi2-triton", "kivi4-triton",
           "leank50", "leank70", "ds8", "ds16", "ds8-shared", "ds16-shared")


def markdown_table(rows: Sequence[dict]) -> str:
    head = ("| op | model | B | ctx | latency (µs) | bytes read (MB) | TB/s | % of 4.3 | vs SDPA | vs reference |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]

    def f(x, fmt):
        return format(x, fmt) + "x" if isinstance(x, (int, float)) else "n/a"

    for r in rows:
        if "latency_us" not in r:
            lines.append(f"| {r['op']} | {r['model']} | {r['batch']} | {r['ctx'] // 1024}k | {r.get('skipped', 'n/a')} "
                         f"| {r['bytes'] / 1e6:.0f} | | | | |")
            continue
        op = f"{r['op']} ({r['impl']})" if r.get("impl") and not r["op"].endswith("-triton") else r["op"]
        lines.append(
            f"| {op} | {r['model']} | {r['batch']} | {r['ctx'] // 1024}k | {r['latency_us']:.1f} | "
            f"{r['bytes'] / 1e6:.1f} | {r['bandwidth_tbps']:.2f} | {r['pct_of_4p3']:.0f}% | "
            f"{f(r.get('speedup_vs_sdpa'), '.2f')} | {f(r.get('speedup_vs_ref'), '.1f')} |")
    return "\n".join(lines)


def run_kernel_benchmarks(device: str | None = None, out: str | None = None, *, quick: bool = False,
                          ops: Sequence[str] = ALL_OPS) -> list[dict]:
    """Benchmark every op in ``kvcompress.kernels``; print a markdown table, write JSON to ``out``.

    Args:
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"`` (default: CUDA when available).
        out: path of a JSON file for the rows (with the conditions: device name, versions).
        quick: three representative shapes instead of the full grid.
        ops: which ops to time (see :data:`ALL_OPS`).

    Returns:
        One dict per (op, shape): latency, bytes read, bandwidth, speed-ups (see the module docstring).
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows: list[dict] = []
    for shape, batch, ctx in _cases(dev, quick):
        _bench_case(shape, batch, ctx, dev, rows, ops)
    print(markdown_table(rows))
    if out:
        info: dict[str, Any] = {"device": str(dev), "torch": torch.__version__}
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
        if dev.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(dev)
        with open(out, "w") as fh:
            json.dump({"conditions": info, "rows": rows}, fh, indent=1)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ops", default=",".join(ALL_OPS))
    args = ap.parse_args(argv)
    run_kernel_benchmarks(args.device, args.out, quick=args.quick, ops=tuple(args.ops.split(",")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
