"""What limits the resident programs of the Triton decode reads, from their real launches, without a GPU.

Each row is one launch that an issue-19 grid op really makes: the read runs on CPU tensors with its ``@triton.jit``
kernels replaced by recorders (``tests/triton_offline.py``), so the constexprs, warps and pipeline depth are the ones
the launch code picks for that batch and head shape (``_launch_shape`` for the lanes kernel; the paged kernel at 2 and
3 stages, its split plan's two depths).  The recorded launch is compiled with Triton's real pipeline for sm_90 and
read with Triton's bundled ``cuobjdump``: registers and spilled bytes per thread, shared memory per program; then
:func:`kvcompress.kernels.attention.triton_shared.occupancy` (the runtime's own residency arithmetic, H200 limits)
gives the programs one SM holds and what limits them.  ``regs for +1``: where registers are the limit, the most
registers per thread at which one more program would fit; with ``--try-caps`` that cap is compiled
(``maxnreg``) and its spills reported.  ``--device-build`` (on a GPU machine): the same launches compiled and loaded
on the CUDA device instead (``warmup``; registers and spills from the driver), to check the offline numbers.

Token counts do not change these kernels' builds (they are runtime arguments), so small inputs stand in for every
context length.  The lanes ops' split counts differ from a GPU's (no SM count here); they are runtime too.  Launch
options that need a device are off here: PDL (the DoubleSparse and KIVI reads take it on the H200) and nothing else.

Use the GPU image's Triton for numbers that hold there (3.6 on the lent H200):

    pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python benchmarks/read_occupancy.py [--try-caps] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LANES_OPS = ("leank50", "leank70", "none", "lowrank", "leank70-kivi2")
BATCHES = (1, 4, 16, 64)


def _record(targets, call):
    """The launches ``call()`` makes of the ``(module, name)`` kernels ``targets`` (recorded, not run)."""
    import pytest
    from triton_offline import record_launches

    patch = pytest.MonkeyPatch()
    try:
        return record_launches(patch, targets, call)
    finally:
        patch.undo()


def cuobjdump(compiled, flag: str) -> str:
    """``cuobjdump FLAG`` (Triton's bundled tool) of the cubin of a kernel compiled by ``triton.compile``."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(compiled.asm["cubin"])
        return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout


def cubin_resources(compiled) -> dict:
    """Registers, stack and local bytes per thread (``cuobjdump -res-usage`` of the cubin) and shared memory per
    program (the compiled kernel's metadata) of a kernel compiled by ``triton.compile``."""
    text = cuobjdump(compiled, "-res-usage")
    got = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return {"registers": int(got["REG"]), "stack_bytes": int(got.get("STACK", 0)),
            "local_bytes": int(got.get("LOCAL", 0)), "shared_bytes": int(compiled.metadata.shared)}


def usage(compiled) -> dict:
    """Registers and spilled (stack + local) bytes per thread and shared memory per program of a compiled kernel
    (:func:`cubin_resources`)."""
    r = cubin_resources(compiled)
    return {"registers": r["registers"], "spill_bytes": r["stack_bytes"] + r["local_bytes"],
            "shared_bytes": r["shared_bytes"]}


def next_step_registers(regs: int, shared: int, num_warps: int) -> int | None:
    """The most registers per thread at which one more program fits an SM, where registers alone limit it and the
    shared memory, threads and blocks leave room for one more (H200 limits); ``None`` otherwise."""
    from kvcompress.kernels.attention.triton_shared import SMLimits, occupancy

    lim = SMLimits()
    programs, limit = occupancy(regs, shared, num_warps, lim)
    if limit != "registers" or occupancy(1, shared, num_warps, lim)[0] <= programs:
        return None
    return lim.registers // ((programs + 1) * num_warps * 256) * 8


def lanes_launches(op: str, shape, batch: int):
    """The lanes kernel's launches of grid op ``op`` at ``batch`` rows (``leank50``/``leank70``: benchutil's grouped
    LeanK read; the static-cache ops: ``StaticLayer._read`` of the layer benchutil builds, its lanes handed to the
    Triton wrapper as the GPU's registered op would)."""
    import torch

    from kvcompress.kernels import benchutil, leank
    from kvcompress.kernels.leank import triton_kernel as tk
    from kvcompress.kernels.leank.reference import Lane

    names = [(tk, n) for n in ("_lanes_kernel", "_combine_kernel", "_combine_splits_kernel")]
    gen = torch.Generator().manual_seed(0)
    m = shape.q_heads // shape.kv_heads
    if op.startswith("leank") and "kivi" not in op:
        q, lanes = benchutil.leank_inputs(batch, shape.kv_heads, 300, shape.head_dim, m, int(op[5:]),
                                          torch.device("cpu"), gen, fp_tokens=200)
        return _record(names, lambda: tk.grouped_partial_attention(q, lanes, 0.1))
    layer = benchutil.build_static_layer(op, shape, batch, 1024, "cpu", gen)
    query = torch.randn(batch, shape.q_heads, 1, shape.head_dim, generator=gen).half()
    found = []
    reference = leank.grouped_partial_attention

    def spy(q, lanes, scale, *, impl=None, length=None, softcap=None, out_dtype=None):
        lanes = [Lane(*lane) for lane in lanes]
        found.extend(_record(names, lambda: tk.grouped_partial_attention(q, lanes, scale, length=length,
                                                                         softcap=softcap, out_dtype=out_dtype)))
        return reference(q, lanes, scale, impl="reference", length=length, softcap=softcap, out_dtype=out_dtype)

    layer.kernels["lanes_partial"] = "triton"  # what choose() gives a CUDA layer
    import pytest

    patch = pytest.MonkeyPatch()
    patch.setattr(leank, "grouped_partial_attention", spy)
    try:
        benchutil.static_read(layer, query, shape.head_dim ** -0.5)
    finally:
        patch.undo()
    return found


PAGED_OPS = ("paged-dense", "paged-length")
LAUNCH_OPTIONS = {"num_warps", "num_stages", "maxnreg"}  # what a variant may set besides the kernel's constexprs


def paged_launches(shape, batch: int, length: bool = False):
    """The paged kernel's launch (16-token pages) as ``paged-dense`` makes it: the dynamic pool's read, no live length
    (``HAS_LENGTH`` off).  ``length``: the op called with a device-tensor live length (``paged-length``; no built-in
    cache reads that way) - the per-slot length mask of the loads costs about 40 registers at Llama heads."""
    import torch

    from kvcompress.kernels.attention import triton_shared
    from kvcompress.kernels.paged import triton_kernel as pg

    gen = torch.Generator().manual_seed(1)
    h, m, d, p, width = shape.kv_heads, shape.q_heads // shape.kv_heads, shape.head_dim, 16, 8
    q = torch.randn(batch, h, m, d, generator=gen).half()
    k, v = (torch.randn(batch * width, h, p, d, generator=gen).half() for _ in range(2))
    valid = torch.ones(batch * width, p, dtype=torch.bool)
    table = torch.arange(batch * width, dtype=torch.int32).view(batch, width)
    live = torch.tensor(width * p - 5) if length else None
    return _record([(pg, "_paged_split_kernel"), (triton_shared, "_combine_tiles_kernel")],
                   lambda: pg._forward(q, k, v, valid, table, 0.1, splits=3, base=pg._config(), length=live))


def device_usage(launch) -> dict:
    """What :func:`usage` reads, from the launch compiled on the current CUDA device (``warmup``: built and loaded,
    not run) - the build a GPU's ``resident_programs`` counts."""
    compiled = launch.fn.warmup(*launch.args, grid=(1, 1, 1), **launch.kwargs)
    compiled._init_handles()
    return {"registers": int(compiled.n_regs), "spill_bytes": int(compiled.n_spills),
            "shared_bytes": int(compiled.metadata.shared)}


def row(op: str, model: str, batch: int, launch, stages: int | None, try_caps: bool, on_device: bool = False) -> dict:
    from triton_offline import Launch, compile_launch

    from kvcompress.kernels.attention.triton_shared import occupancy

    kwargs = dict(launch.kwargs)
    if stages is not None:
        kwargs["num_stages"] = stages
    warps = int(kwargs.get("num_warps", 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = Launch(launch.fn, launch.args, kwargs)
        got = device_usage(built) if on_device else usage(compile_launch(built))
        programs, limit = occupancy(got["registers"], got["shared_bytes"], warps)
        cap = next_step_registers(got["registers"], got["shared_bytes"], warps)
        capped = None
        if cap is not None and try_caps:
            capped_launch = Launch(launch.fn, launch.args, {**kwargs, "maxnreg": cap})
            capped = device_usage(capped_launch) if on_device else usage(compile_launch(capped_launch))
    lanes = kwargs.get("DKP")
    return {"op": op, "model": model, "batch": batch, "kernel": launch.fn.fn.__name__, "warps": warps,
            "stages": kwargs.get("num_stages"), "lanes": list(lanes) if lanes else None,
            "block_n": kwargs["BN"] if "BN" in kwargs else kwargs.get("P", 0) * kwargs.get("NBP", 0) or None, **got,
            "programs_per_sm": programs, "limit": limit, "regs_for_one_more": cap, "capped": capped}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default=",".join(LANES_OPS + PAGED_OPS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--models", default="llama3-8b,smollm2-135m")
    ap.add_argument("--try-caps", action="store_true", help="compile the 'regs for +1' cap and report its spills")
    ap.add_argument("--device-build", action="store_true",
                    help="compile on the current CUDA device (the driver reads the build) instead of offline")
    ap.add_argument("--variants", default="[{}]",
                    help='JSON list of launch overrides, each a row per launch (constexprs and options, e.g. '
                         '\'[{}, {"BN": 32, "num_stages": 4}, {"num_warps": 8, "num_stages": 3}]\'; {}: as launched)')
    ap.add_argument("--out", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    variants = json.loads(args.variants)
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        ap.error(f"--variants must be a JSON list of objects, got {args.variants!r}")
    sys.path.insert(0, str(ROOT / "tests"))  # triton_offline: the recorders and the offline compile
    import triton
    from triton_offline import Launch

    from kvcompress.kernels import benchutil

    shapes = {s.model: s for s in benchutil.SHAPES}
    rows, seen = [], set()
    for model in args.models.split(","):
        for op in args.ops.split(","):
            for batch in map(int, args.batches.split(",")):
                if op in PAGED_OPS:  # the paged kernel at both depths its rule picks from, unless a variant says
                    launches = paged_launches(shapes[model], batch, length=op == "paged-length")[:1]
                    stage_list = (2, 3)
                else:
                    launches, stage_list = lanes_launches(op, shapes[model], batch)[:1], (None,)
                for launch, variant, stages in ((x, v, st) for x in launches for v in variants
                                                for st in ((v["num_stages"],) if "num_stages" in v else stage_list)):
                    if not set(variant) <= set(launch.fn.arg_names) | LAUNCH_OPTIONS:
                        continue  # another kernel's constexprs (e.g. the lanes kernel's BN for a paged op)
                    changed = Launch(launch.fn, launch.args, {**launch.kwargs, **variant})
                    r = row(op, model, batch, changed, variant.get("num_stages", stages), args.try_caps,
                            args.device_build)
                    r["variant"] = variant
                    key = (op, model, json.dumps(variant, sort_keys=True), r["stages"], r["registers"],
                           r["shared_bytes"])
                    if key in seen:  # the same build as a smaller batch's: one row, its batches listed
                        next(x for x in rows if x["key"] == key)["batches"].append(batch)
                        continue
                    seen.add(key)
                    r["key"], r["batches"] = key, [batch]
                    rows.append(r)
                    print(f"{op} {model} B{batch} {variant or ''} st{r['stages']}: {r['registers']} regs, "
                          f"{r['shared_bytes']} B shared -> {r['programs_per_sm']} per SM ({r['limit']})",
                          file=sys.stderr, flush=True)
    where = "built on the CUDA device" if args.device_build else "sm_90 offline"
    print(f"Triton {triton.__version__}, {where}, H200 limits (65536 registers, 228 KB shared memory per SM)\n")
    print("| op | model | batches | kernel | lanes (padded key widths) | tokens / step | warps | stages | registers | spilled B | "
          "shared B | programs / SM | limit | regs for +1 |" + (" capped: regs / spilled B |" if args.try_caps else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.try_caps else ""))
    for r in rows:
        cap = r["regs_for_one_more"] or "-"
        line = (f"| {r['op']} | {r['model']} | {','.join(map(str, r['batches']))} | {r['kernel']} | "
                f"{r['lanes'] or '-'} | {r['block_n'] or '-'} | {r['warps']} | {r['stages']} | {r['registers']} | "
                f"{r['spill_bytes']} | {r['shared_bytes']} | {r['programs_per_sm']} | {r['limit']} | {cap} |")
        if args.try_caps:
            c = r["capped"]
            line += f" {c['registers']} / {c['spill_bytes']} |" if c else " - |"
        print(line)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"triton": triton.__version__, "rows": [{k: v for k, v in r.items() if k != "key"} for r in rows]},
                  fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
