"""CPU proxy of the host overhead of an eager decode step (issue 16: "every built-in stack's eager decode
step within 1.25x of plain transformers' eager step").

An eager decode step on a GPU is host-bound: the GPU idles while Python issues one small kernel after the
other.  This script measures the same host work on the CPU with a model whose *structure* is Llama-3-8B's
(32 layers, 32 query / 8 KV heads) but whose dimensions are tiny (hidden 64, head_dim 32, intermediate 128,
vocab 1024; random weights, fp32, one thread), so the arithmetic is small and the step's time is mostly
dispatch and Python (head_dim 32 is the smallest the benchmark stacks build on: KIVI packs 16 two-bit codes
per word, ``lowrank32-random`` keeps 32 coordinates):

    .venv/bin/python benchmarks/eager_overhead.py [--stack builtin snapkv tova1024 expected_attention]
        [--prefill 1152] [--steps 128] [--time-steps 48] [--rounds 3] [--top 12] [--json OUT]

Rows: plain transformers (``DynamicCache``) eager, then every stack with the dynamic cache
(``kvcompress.compress(model, stack)``) and with the static cache run eagerly
(``compress(model, stack, max_cache_len=...)``, no compile).  Stacks are resolved by
:func:`kvcompress.evaluation.e2e.resolve_stacks`, as the GPU benchmark resolves them (``builtin`` = its
benchmark set; ``lowrank32-random*`` get a random key basis written for this model).  Each row prefills
``--prefill`` random tokens (past every stack's windows and budgets, so flushes, KIVI groups, page and
token evictions all happen during the counted steps), runs 4 untimed steps, then, in the op-counting pass,
runs ``--steps`` single-token steps under a ``TorchDispatchMode`` (128 by default: every stack flushes or evicts
at least once, LeanK's and low-rank's 128-token flushes included), and in each timed round times
``--time-steps`` steps one by one.  Rounds visit the rows in turn (a noisy machine slows all rows alike).

Per row: the median wall ms per step (the median over rounds of each round's median step), its ratio to the
plain row, the mean wall ms per timed step (flush steps included), and, from the op-counting pass (means over
the counted steps, flushes and evictions included):

* **aten ops** per step: every op dispatched (the robust proxy of dispatch and launch overhead: timings on a
  shared machine are noisy).  On the CPU the read path runs the kernels' PyTorch references, many ops each;
* **kernel ops**: the same count with each call of such a reference (an attention partial over a region, a
  KIVI / paged / LeanK-lanes read, DoubleSparse's selection and gather: :func:`reference_kernels`) counted as
  one op, as a GPU launches it (an upper bound there: a GPU also fuses a decode step's full-precision regions
  into one launch, the CPU reads them one by one);
* **host reads** per step (``item`` / ``is_nonzero`` / ``nonzero`` ops: ``.item()``, ``bool(t)``, ``int(t)``,
  ``t.nonzero()``, a device synchronisation each on a GPU; ``tolist`` dispatches no op and is not counted).

``--top K`` prints each row's K most frequent ops per step; ``--cprofile N`` times the steps once more under
cProfile and prints each row's N functions with the most own time.  ``--device cuda`` runs the same tiny model on
a GPU (bf16), where a step is host-bound and its wall time is the host overhead itself.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: The proxy model: Llama-3-8B's structure (layers, heads, GQA ratio), tiny dimensions.
PROXY_SHAPE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=32, max_position_embeddings=8192,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)

DEFAULT_STACKS = ["builtin", "snapkv", "tova1024", "expected_attention"]
WARMUP = 4
#: ops that read a tensor's values on the host (a device synchronisation on a GPU); ``tolist`` dispatches no op
HOST_READS = ("item", "is_nonzero", "_local_scalar_dense", "nonzero", "equal")


def reference_kernels() -> set:
    """Code objects of the PyTorch references that stand for ONE kernel launch on a GPU (the CPU runs them as many
    ops): attention partials over a full-precision region, a KIVI / paged region, LeanK lanes, DoubleSparse's
    selection and gather.  Counted once per call in the "kernel ops" column."""
    from kvcompress.kernels.attention import reference as attention
    from kvcompress.kernels.doublesparse import reference as doublesparse
    from kvcompress.kernels.kivi import reference as kivi
    from kvcompress.kernels.leank import reference as leank
    from kvcompress.kernels.paged import reference as paged

    fns = (attention.partial_attention, kivi.kivi_attention_partial, paged.paged_attention_partial,
           leank.grouped_partial_attention, doublesparse.select_topk, doublesparse.gather_partial_attention,
           doublesparse.quantize_labels)
    return {fn.__code__ for fn in fns}


class OpCounter(TorchDispatchMode):
    """Counts every aten (and custom) op dispatched while active, and the "kernel ops": the same count with each
    call of a reference kernel (:func:`reference_kernels`, the outermost one when they nest) counted as one op."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.kernel_ops = 0
        self._codes = reference_kernels()
        self._last: Any = None  # the frame of the last kernel call counted (held: its id cannot be reused)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        frame, kernel = sys._getframe(1), None
        while frame is not None:
            if frame.f_code in self._codes:
                kernel = frame
            frame = frame.f_back
        if kernel is None:
            self.kernel_ops += 1
        elif kernel is not self._last:
            self.kernel_ops, self._last = self.kernel_ops + 1, kernel
        return func(*args, **(kwargs or {}))

    def per_step(self, steps: int) -> collections.Counter:
        """Ops per step by name (``aten.add``; overloads merged)."""
        out: collections.Counter = collections.Counter()
        for func, n in self.counts.items():
            out[str(func.overloadpacket)] += n / steps
        return out


def proxy_model(layers: int = 32, device: str = "cpu") -> Any:
    from kvcompress.adapters import hf

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return hf.random_llama({**PROXY_SHAPE, "num_hidden_layers": layers}, "proxy-llama3-8b-structure", device,
                           dtype, seed=0)


class Row:
    """One row: a cache kind (``plain`` / ``dynamic`` / ``static``) and a stack."""

    def __init__(self, kind: str, stack: Any = None):
        self.kind, self.stack = kind, stack
        self.label = "transformers DynamicCache" if kind == "plain" else (
            stack.label + (" static" if kind == "static" else ""))
        self.times: list[list[float]] = []  # per round: wall seconds of each timed step
        self.ops: collections.Counter | None = None
        self.kernel_ops: float | None = None
        self.profile: Any = None
        self.error: str | None = None

    @contextlib.contextmanager
    def cache(self, model: Any, capacity: int, batch: int):
        import kvcompress
        from transformers import DynamicCache

        if self.kind == "plain":
            yield DynamicCache(config=model.config)
        elif self.kind == "dynamic":
            with kvcompress.compress(model, self.stack) as cache:
                yield cache
        else:
            with kvcompress.compress(model, self.stack, max_cache_len=capacity, max_batch_size=batch) as cache:
                yield cache


def run_row(model: Any, row: Row, prompt: torch.Tensor, decode_ids: torch.Tensor, count_ops: bool | str,
            steps_counted: int, steps_timed: int) -> None:
    """Prefill, warm up, then the timed steps (or, with ``count_ops``, the same steps under an op counter; with
    ``count_ops="cprofile"``, the timed steps under cProfile)."""
    from kvcompress.adapters import hf

    batch, ctx = prompt.shape
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    steps = steps_counted if count_ops is True else steps_timed
    kw_name = hf.cache_kwarg(model)
    with torch.inference_mode(), row.cache(model, ctx + decode_ids.shape[0] + 8, batch) as cache:
        def call(ids: torch.Tensor, start: int) -> None:
            pos = torch.arange(start, start + ids.shape[1], device=device)
            model(input_ids=ids, position_ids=pos.unsqueeze(0).expand(batch, -1), logits_to_keep=1,
                  use_cache=True, **{kw_name: cache})

        call(prompt, 0)
        for i in range(WARMUP):
            call(decode_ids[i], ctx + i)
        if count_ops == "cprofile":
            import cProfile

            row.profile = cProfile.Profile()
            row.profile.enable()
            for i in range(WARMUP, WARMUP + steps):
                call(decode_ids[i], ctx + i)
            sync()
            row.profile.disable()
            return
        if count_ops:
            counter = OpCounter()
            with counter:
                for i in range(WARMUP, WARMUP + steps):
                    call(decode_ids[i], ctx + i)
            row.ops = counter.per_step(steps)
            row.kernel_ops = counter.kernel_ops / steps
            counter._last = None
            return
        times = []
        for i in range(WARMUP, WARMUP + steps):
            sync()
            t0 = time.perf_counter()
            call(decode_ids[i], ctx + i)
            sync()
            times.append(time.perf_counter() - t0)
        row.times.append(times)


def summarize(rows: list[Row]) -> list[dict[str, Any]]:
    plain = rows[0]
    out = []
    base_ms = base_ops = base_kernel = None
    for row in rows:
        d: dict[str, Any] = {"row": row.label, "kind": row.kind, "error": row.error}
        if row.times:
            d["median_ms"] = statistics.median(statistics.median(t) for t in row.times) * 1e3
            d["mean_ms"] = statistics.median(statistics.fmean(t) for t in row.times) * 1e3
            d["round_medians_ms"] = [round(statistics.median(t) * 1e3, 3) for t in row.times]
        if row.ops is not None:
            d["ops"] = sum(row.ops.values())
            d["host_reads"] = sum(row.ops.get(f"aten.{op}", 0.0) for op in HOST_READS)
            d["kernel_ops"] = row.kernel_ops
            d["top_ops"] = dict(row.ops.most_common(25))
        if row is plain:
            base_ms, base_ops, base_kernel = d.get("median_ms"), d.get("ops"), d.get("kernel_ops")
        d["ratio_ms"] = d["median_ms"] / base_ms if base_ms and "median_ms" in d else None
        d["ratio_ops"] = d["ops"] / base_ops if base_ops and "ops" in d else None
        d["ratio_kernel_ops"] = d["kernel_ops"] / base_kernel if base_kernel and d.get("kernel_ops") else None
        out.append(d)
    return out


def table(results: list[dict[str, Any]], bar: float) -> str:
    head = ("row", "median ms", "x plain", "mean ms", "aten ops", "x plain", "kernel ops", "x plain", "host reads")
    lines = []
    for d in results:
        if d.get("error"):
            lines.append((d["row"], "error: " + d["error"][:80]) + ("",) * (len(head) - 2))
            continue
        f = (lambda key, fmt: fmt.format(d[key]) if d.get(key) is not None else "-")
        flag = (lambda key: " *" if d.get(key) is not None and d[key] > bar else "")
        lines.append((d["row"], f("median_ms", "{:.2f}"), f("ratio_ms", "{:.2f}") + flag("ratio_ms"),
                      f("mean_ms", "{:.2f}"), f("ops", "{:.0f}"), f("ratio_ops", "{:.2f}") + flag("ratio_ops"),
                      f("kernel_ops", "{:.0f}"), f("ratio_kernel_ops", "{:.2f}") + flag("ratio_kernel_ops"),
                      f("host_reads", "{:.1f}")))
    widths = [max(len(str(r[i])) for r in [head] + lines) for i in range(len(head))]
    fmt = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head), "-" * len(fmt(head))] + [fmt(r) for r in lines]) + f"\n(* above {bar}x plain)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stack", nargs="*", default=DEFAULT_STACKS,
                    help="stack names as `kvcompress bench --stack` takes them (default: %(default)s)")
    ap.add_argument("--kinds", default="dynamic,static", help="comma-separated: dynamic, static")
    ap.add_argument("--prefill", type=int, default=1152)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=128, help="decode steps of the op-counting pass")
    ap.add_argument("--time-steps", type=int, default=48, help="decode steps timed per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--no-ops", action="store_true", help="skip the op-counting pass")
    ap.add_argument("--no-time", action="store_true", help="skip the timed rounds (op counts only)")
    ap.add_argument("--top", type=int, default=0, help="print each row's TOP most frequent ops per step")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="one more pass of the timed steps under cProfile: print each row's N functions with the "
                    "most own time")
    ap.add_argument("--bar", type=float, default=1.25)
    ap.add_argument("--device", default="cpu", help="cpu (fp32, the proxy) or cuda (bf16: the same tiny model on a "
                    "GPU, where the step is host-bound and its wall time is the host overhead itself)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    import kvcompress  # noqa: F401  (registers the built-in compressors)
    from kvcompress.evaluation.e2e import resolve_stacks

    model = proxy_model(args.layers, args.device)
    stacks = resolve_stacks(args.stack, model)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    rows = [Row("plain")] + [Row(kind, st) for st in stacks for kind in ("dynamic", "static") if kind in kinds]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(PROXY_SHAPE["vocab_size"], (args.batch, args.prefill), generator=g).to(args.device)
    decode_ids = torch.randint(PROXY_SHAPE["vocab_size"], (WARMUP + max(args.steps, args.time_steps), args.batch, 1),
                               generator=g).to(args.device)

    passes = ([] if args.no_ops else [("ops", True)]) + ([] if args.no_time else
                                                         [(f"round {r + 1}", False) for r in range(args.rounds)])
    if args.cprofile:
        passes.append(("cprofile", "cprofile"))
    for name, count_ops in passes:
        t0 = time.perf_counter()
        for row in rows:
            if row.error:
                continue
            try:
                run_row(model, row, prompt, decode_ids, count_ops, args.steps, args.time_steps)
            except Exception as exc:  # recorded in the row; the others go on
                row.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
        if args.json:  # rewritten after every pass: an interrupted run keeps what it measured
            write_json(args.json, args, summarize(rows), complete=False)

    results = summarize(rows)
    print(f"eager decode step, {args.device} proxy: {args.layers} layers, 32/8 heads, head_dim 32, hidden 64, "
          f"{next(model.parameters()).dtype}, 1 thread; batch {args.batch}, prefill {args.prefill}; ops: mean of {args.steps} steps, "
          f"ms: median of {args.time_steps} steps, median of {args.rounds} rounds")
    print(table(results, args.bar))
    if args.top:
        for d in results:
            if d.get("top_ops"):
                top = list(d["top_ops"].items())[: args.top]
                print(f"\n{d['row']}: " + ", ".join(f"{k.replace('aten.', '')} {v:.0f}" for k, v in top))
    if args.cprofile:
        import io
        import pstats

        for row in rows:
            if row.profile is not None:
                text = io.StringIO()
                pstats.Stats(row.profile, stream=text).sort_stats("tottime").print_stats(args.cprofile)
                body = text.getvalue()
                print(f"\n== {row.label}: cProfile of {args.time_steps} steps\n" + body[body.find("   ncalls"):].rstrip())
    if args.json:
        write_json(args.json, args, results, complete=True)
    return 0


def write_json(path: str, args: Any, results: list[dict[str, Any]], complete: bool) -> None:
    with open(path, "w") as fh:
        json.dump({"schema": "kvcompress.eager_overhead/1", "complete": complete, "args": vars(args),
                   "environment": {"torch": torch.__version__, "threads": torch.get_num_threads()},
                   "rows": results}, fh, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
