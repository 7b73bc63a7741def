"""Worker of tests/test_tensor_parallel.py, launched once under ``torchrun --nproc-per-node 2`` (gloo, CPU).

``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_worker.py CASES.json OUT_DIR``

For every model folder and stack of CASES.json, each rank loads the model with transformers' tensor parallelism
(``tp_plan="auto"``) and runs the stack through ``kvcompress.compress`` unchanged: one prefill of the prompt, then
teacher-forced decode steps (the same fixed tokens in every run, so a near-tie in an argmax cannot make two runs
read different tokens).  Rank 0 writes the tensor-parallel logits; then each rank runs, with the model loaded
without tensor parallelism, the single-process reference of half the cases (case ``i`` on rank ``i % 2``), so the
two cores share that work.  Memory reports (this rank's and the summed one) go to JSON, and so do the messages of
the calibration files this rank must refuse.  Nothing is compared here: the test module compares.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch


def run_case(model, stack, prompt, steps, static=False, compiled=False):
    """Prefill, then one step per token of ``steps``; ``static``: a cache with a capacity (the graph-capturable
    static cache, run eagerly), positions passed explicitly as transformers' compiled decode does; ``compiled``: the
    static cache's decode steps through ``torch.compile(fullgraph=True, backend="aot_eager")`` (the CPU's compiled
    decode; the collectives of the split model inside the graph)."""
    import kvcompress
    from kvcompress.adapters import hf

    kw = hf.cache_kwarg(model)
    n = prompt.shape[1]
    static = static or compiled
    extra = {"max_cache_len": n + steps.shape[1] + 1, "max_batch_size": prompt.shape[0]} if static else {}

    def pos(a, b):
        return {"position_ids": torch.arange(a, b).unsqueeze(0), "cache_position": torch.arange(a, b)} if static \
            else {}

    with kvcompress.compress(model, stack, **extra) as cache, torch.no_grad():
        step = torch.compile(model.forward, backend="aot_eager", fullgraph=True) if compiled else model.forward
        out = model(input_ids=prompt, **{kw: cache}, **pos(0, n))
        logits = [out.logits[:, -1].float()]
        for t in range(steps.shape[1]):
            out = step(input_ids=steps[:, t:t + 1], **{kw: cache}, **pos(n + t, n + t + 1))
            logits.append(out.logits[:, -1].float())
        return torch.stack(logits, 1).contiguous(), cache


def report_dict(report):
    return {"segments": report.segments, "dense_fp16_bytes": report.dense_fp16_bytes,
            "dense_native_bytes": report.dense_native_bytes, "tokens": report.tokens, "batch": report.batch,
            "ranks": report.ranks, "replicated_bytes": report.replicated_bytes}


def main() -> int:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cases_path, out_dir = sys.argv[1], sys.argv[2]
    with open(cases_path) as fh:
        spec = json.load(fh)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(spec["seed"])
    prompt = torch.randint(1, 256, (1, spec["prompt"]), generator=gen)
    steps = torch.randint(1, 256, (1, spec["steps"]), generator=gen)
    tensors: dict[str, torch.Tensor] = {}
    results: dict[str, dict] = {}
    rank = None
    index = 0
    for model_name, folder in spec["models"].items():
        start = time.perf_counter()
        tp = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32).eval()
        if rank is None:
            rank = dist.get_rank()
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        results[f"load/{model_name}"] = {"seconds": time.perf_counter() - start}
        for stack_name, stack in spec["stacks"][model_name].items():
            key = f"{model_name}/{stack_name}"
            entry = results[key] = {}
            start = time.perf_counter()
            try:
                logits, cache = run_case(tp, stack, prompt, steps)
                entry["local_report"] = report_dict(cache.memory_report())
                entry["summed_report"] = report_dict(cache.memory_report(all_ranks=True))
                entry["shard"] = cache.shard.describe() if cache.shard is not None else None
                if rank == 0:
                    tensors[f"tp/{key}"] = logits
            except Exception as exc:  # recorded per case: the test names the case and the error
                entry["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
            entry["seconds"] = time.perf_counter() - start
        for stack_name in spec.get("static", []):  # static caches (capacity preallocated) under the same split
            key = f"{model_name}/{stack_name}@static"
            entry = results[key] = {}
            start = time.perf_counter()
            try:
                logits, cache = run_case(tp, spec["stacks"][model_name][stack_name], prompt, steps, static=True)
                entry["is_static"] = cache.is_static
                entry["local_report"] = report_dict(cache.memory_report())
                entry["summed_report"] = report_dict(cache.memory_report(all_ranks=True))
                entry["shard"] = cache.shard.describe() if cache.shard is not None else None
                if rank == 0:
                    tensors[f"tp/{key}"] = logits
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
            entry["seconds"] = time.perf_counter() - start
        for stack_name in spec.get("compiled", {}).get(model_name, []):  # compiled decode steps under the split
            key = f"{model_name}/{stack_name}@compiled"
            entry = results[key] = {}
            start = time.perf_counter()
            try:
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()  # (reset keeps the counters: graphs of this stack only)
                stack = spec["stacks"][model_name][stack_name]
                eager, _ = run_case(tp, stack, prompt, steps, static=True)
                compiled, _ = run_case(tp, stack, prompt, steps, compiled=True)
                entry["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
                if rank == 0:
                    tensors[f"tp/{key}"], tensors[f"tp/{key}/eager"] = compiled, eager
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
            torch._dynamo.reset()
            entry["seconds"] = time.perf_counter() - start
        # the single-process references, half on each rank (both cores busy, no collective in between)
        for stack_name, stack in spec["stacks"][model_name].items():
            key = f"{model_name}/{stack_name}"
            index += 1
            if index % 2 != rank:
                continue
            entry = results[key]
            start = time.perf_counter()
            try:
                logits, cache = run_case(ref, stack, prompt, steps)
                tensors[f"ref/{key}"] = logits
                entry["ref_report"] = report_dict(cache.memory_report())
            except Exception as exc:
                entry["ref_error"] = f"{type(exc).__name__}: {exc}"
            entry["ref_seconds"] = time.perf_counter() - start
        for stack_name in spec.get("static", []):  # the static caches' single-process reports (memory only)
            index += 1
            if index % 2 != rank:
                continue
            entry = results[f"{model_name}/{stack_name}@static"]
            try:
                _, cache = run_case(ref, spec["stacks"][model_name][stack_name], prompt, steps, static=True)
                entry["ref_report"] = report_dict(cache.memory_report())
            except Exception as exc:
                entry["ref_error"] = f"{type(exc).__name__}: {exc}"
        for label, stack in spec["refused"].get(model_name, {}).items():
            try:
                with kvcompress_compress(tp, stack):
                    pass
                results[f"refused/{model_name}/{label}"] = {"message": None}
            except Exception as exc:
                results[f"refused/{model_name}/{label}"] = {"type": type(exc).__name__, "message": str(exc)}
        del tp, ref
    if spec.get("cli"):  # `kvcompress generate` under this torchrun launch: tensor parallel, rank 0 prints
        import contextlib
        import io

        from kvcompress import cli

        for name in ("cli", "cli_compiled"):
            out, start = io.StringIO(), time.perf_counter()
            with contextlib.redirect_stdout(out):
                code = cli.main(spec[name])
            results[name] = {"code": code, "stdout": out.getvalue(), "seconds": time.perf_counter() - start}
    for name in ("bench", "bench_throughput"):  # `kvcompress bench --model-shape` under this launch: random weights
        if not spec.get(name):  # split over the ranks (latency rows; tokens/s at a KV budget per rank)
            continue
        import contextlib
        import io

        from kvcompress import cli

        out, start = io.StringIO(), time.perf_counter()
        with contextlib.redirect_stdout(out):
            code = cli.main(spec[name])
        results[name] = {"code": code, "stdout": out.getvalue(), "seconds": time.perf_counter() - start}
    save_file(tensors, os.path.join(out_dir, f"logits_rank{rank}.safetensors"))
    with open(os.path.join(out_dir, f"results_rank{rank}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def kvcompress_compress(model, stack):
    import kvcompress

    return kvcompress.compress(model, stack)


if __name__ == "__main__":
    sys.exit(main())
