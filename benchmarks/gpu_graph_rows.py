"""Decode-step rows of kvcompress' own CUDA-graph replay (kvcompress.graphs.GraphStep) on the GPU machine:
    python benchmarks/gpu_graph_rows.py --stack kivi2 none --points 1x32768 8x16384 --out DIR
    python benchmarks/gpu_graph_rows.py --stack none kivi4 paged-1024 --points 1x32768 --jobs 3 --out DIR
Same measurement as benchmarks/e2e_decode.py (kvcompress.evaluation.e2e.measure_row), "graph" rows only
(warm-up until the planned step's flush variant is captured too - ``graph_warmup``; 32 timed and 32 profiled
steps, each window holding one KIVI flush: ``wall_mean_ms`` and ``gpu_busy_ms`` average over the flush period):
the Llama-3-8B shape with random bf16 weights, static cache, torch.compile(fullgraph=True) without CUDA-graph
trees, captured once and replayed.

``--jobs N`` prepares N stacks at once, one process each (compiling a 32-layer step takes ~130 s of
mostly single-threaded host work, so one process per stack spreads it over the machine's cores).  The
processes share one copy of the weights (built by the parent, passed to the workers as CUDA IPC tensors) and
prefill and time one row at a time: each worker prefills (one at a time), compiles and warms up, waits until every worker of the point
is ready (or failed, or ``--ready-timeout`` passed), then takes a file lock for its timed and profiled
steps, so no other process uses the GPU while a row is timed.  Rows are the same as those of a serial run.
``--kind compiled`` measures reduce-overhead rows instead; ``--device cpu --shape tiny`` checks the
machinery on the CPU (aot_eager, no graph)."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import queue
import sys
import tempfile
import time

import torch

from kvcompress.evaluation import e2e

KEYS = ("label", "batch", "context", "wall_ms", "wall_mean_ms", "gpu_busy_ms", "graph_variants", "graph_direct_timed", "wall_over_busy", "kernels_per_step", "compile_s",
        "graphs", "cache_bytes", "timed_alone", "error")


class Turn:
    """A file lock held while one worker prefills; for timing, first a barrier over ``n`` workers (ready files in
    ``folder``), then the lock."""

    def __init__(self, folder: str, n: int, name: str, deadline: float):
        self.folder, self.n, self.name, self.deadline = folder, n, name, deadline
        self.complete = None  # whether every worker was ready when this one was timed

    def mark_ready(self) -> None:
        open(os.path.join(self.folder, f"ready.{self.name}"), "w").close()

    def ready_count(self) -> int:
        return sum(f.startswith("ready.") for f in os.listdir(self.folder))

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if phase == "time":
            self.mark_ready()
            while self.ready_count() < self.n and time.time() < self.deadline:
                time.sleep(0.25)
            self.complete = self.ready_count() >= self.n
        with open(os.path.join(self.folder, "lock"), "w") as fd:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                if phase == "prefill" and torch.cuda.is_available():
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()  # give the prefill's transient blocks back to the other workers
                fcntl.flock(fd, fcntl.LOCK_UN)


def share(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) of ``model`` by name: what a worker needs to rebuild it."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    return {k: v.detach() for k, v in named.items()}


def rebuild(shape: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
    """The model of ``e2e.random_model(shape)`` built on the meta device, then given ``tensors`` (no copy)."""
    with torch.device("meta"):
        model = e2e.random_model(shape, "meta", dtype)
    for name, t in tensors.items():
        owner, _, leaf = name.rpartition(".")
        mod = model.get_submodule(owner)
        if leaf in mod._parameters:
            mod._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
        elif leaf in mod._buffers:
            mod._buffers[leaf] = t
        else:
            raise KeyError(name)
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:
        raise RuntimeError(f"tensors not shared: {left[:5]}")
    for mod in model.modules():  # plain tensor attributes (e.g. a rotary embedding's original_inv_freq)
        for k, v in list(vars(mod).items()):
            if isinstance(v, torch.Tensor) and v.is_meta:
                ref = getattr(mod, k.removeprefix("original_"), None)
                if isinstance(ref, torch.Tensor) and not ref.is_meta:
                    setattr(mod, k, ref.clone())
    return model


def worker(args, name: str, tensors: dict[str, torch.Tensor], folder: str, n: int, deadline: float,
           results) -> None:
    turn = Turn(folder, n, "".join(c if c.isalnum() or c in "_.-" else "_" for c in name), deadline)  # a file name
    rows = []
    try:
        model = rebuild(args.shape, tensors, getattr(torch, args.dtype))
        b, c = (int(x) for x in args.point.split("x"))
        stack = e2e.resolve_stacks([name], model)[0]
        label = f"{name} + compile" + (" + CUDA graph" if args.kind == "graph" else "")
        row = e2e.measure_row(model, e2e.RowSpec(args.kind, label, stack), b, c, gate=turn,
                              prefill_tokens=args.prefill_tokens, **steps(args))
        row["timed_alone"] = turn.complete
        rows.append(row)
    except Exception as exc:  # noqa: BLE001 - report it as the row's error
        rows.append({"label": name, "error": f"{type(exc).__name__}: {exc}"[:400]})
    finally:
        turn.mark_ready()  # a failed worker must not hold the others at the barrier
        results.put(rows)


def run_parallel(args, model, out_rows: list) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    tensors = share(model)
    for point in args.points:
        names = list(args.stack)
        while names:
            wave, names = names[:args.jobs], names[args.jobs:]
            with tempfile.TemporaryDirectory() as folder:
                results = ctx.Queue()
                a = argparse.Namespace(**{**vars(args), "point": point})
                deadline = time.time() + args.ready_timeout
                procs = [ctx.Process(target=worker, args=(a, s, tensors, folder, len(wave), deadline, results))
                         for s in wave]
                for p in procs:
                    p.start()
                got = 0
                while got < len(procs):
                    try:
                        rows = results.get(timeout=5)
                    except queue.Empty:
                        if not any(p.is_alive() for p in procs):
                            break
                        continue
                    got += 1
                    for row in rows:
                        yield_row(args, row, out_rows)
                for p in procs:
                    p.join(timeout=30)
                for s, p in zip(wave, procs):
                    if p.exitcode not in (0, None) and not any(r.get("label", "").startswith(s) for r in out_rows):
                        yield_row(args, {"label": s, "batch": point, "error": f"worker exit code {p.exitcode}"},
                                  out_rows)


def yield_row(args, row: dict, out_rows: list) -> None:
    out_rows.append(row)
    print(json.dumps({k: row.get(k) for k in KEYS}), flush=True)
    with open(os.path.join(args.out, "graph_rows.json"), "w") as f:
        json.dump({"environment": e2e.environment(torch.device(args.device)), "jobs": args.jobs,
                   "rows": out_rows}, f, indent=1)


def steps(args) -> dict[str, int]:
    return {"warmup": args.warmup, "steps": args.steps, "profile_steps": args.profile_steps}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stack", nargs="+", default=["kivi2"])
    ap.add_argument("--points", nargs="+", default=["1x32768"])
    ap.add_argument("--out", default="out")
    ap.add_argument("--jobs", type=int, default=1, help="stacks prepared at once, one process each")
    ap.add_argument("--kind", choices=("graph", "compiled"), default="graph")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(e2e.SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefill-tokens", type=int, default=32768, help="tokens per prefill chunk over the batch")
    ap.add_argument("--ready-timeout", type=float, default=480.0,
                    help="seconds after which a worker times its row even if others are not ready")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed steps first (at least what captures every plan's graph: e2e.graph_warmup)")
    ap.add_argument("--steps", type=int, default=32, help="timed steps (32: one KIVI flush among them)")
    ap.add_argument("--profile-steps", type=int, default=32, help="profiled steps (GPU-busy time, kernel table)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = e2e.random_model(args.shape, args.device, getattr(torch, args.dtype))
    rows: list = []
    if args.jobs > 1:
        run_parallel(args, model, rows)
        return 0
    for point in args.points:
        b, c = (int(x) for x in point.split("x"))
        for name in args.stack:
            stack = e2e.resolve_stacks([name], model)[0]
            label = f"{name} + compile" + (" + CUDA graph" if args.kind == "graph" else "")
            yield_row(args, e2e.measure_row(model, e2e.RowSpec(args.kind, label, stack), b, c,
                                            prefill_tokens=args.prefill_tokens, **steps(args)), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
