"""GPU check of the fused Triton KIVI quantizer (``kvcompress::kivi_quantize``, impl "triton") against the reference.

For every case the op runs with ``impl="reference"`` (the reference quantizers, ~45 launches) and ``impl="triton"``
(one launch, :mod:`kvcompress.kernels.kivi.quantize_triton`) on the same CUDA inputs; the script records

* code mismatches (2/4-bit codes that differ, counted inside the packed words), and how many of them sit at
  masked slots (the one documented caveat: a masked slot takes its group's mean, whose fp32 sum may be reduced in
  another order; only fp32 inputs can show it in practice);
* whether scales and zeros are bit-equal (fp16 bits);
* timings with CUDA events (:func:`kvcompress.kernels.benchutil.time_op`, median, microseconds per call): eager
  launches and a CUDA graph (what a compiled decode step replays), reference and Triton.

Cases: a grid like ``tests/test_kivi_quantize_kernel.py`` (B / H, 1-4 token groups, G 16-128, Gv dividing d, head
dims 64 / 96 / 128 / 72 (keys padded), bits 2 / 4, bf16 / fp16 / fp32, per-token keys, masks none / random / dead
group / dead row / left padding, strided inputs), Llama-3-8B decode shapes (B 1 / 8, H 8, T 32 / 128, d 128) and
prefill shapes (B 1, H 8, T 32768, d 128).  Each case runs in try/except: an error is recorded, never fatal.

Run from the repository root on a CUDA machine (the package importable as ``kvcompress``; if it is not, the script
assembles /tmp/site as benchmarks/gpu_session.sh does)::

    python benchmarks/gpu_kivi_quantize.py --out DIR [--quick] [--only decode,prefill,grid] [--reps 20]

Writes ``DIR/gpu_kivi_quantize.json`` (rewritten after every case) and prints a table; exit status 0 when every
case is exact or differs only at masked slots.  ``--dry-run`` runs the grid on CPU with the kernel under the Triton
interpreter (no timings): a smoke test of this script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

MASKS = (None, "random", "dead_group", "dead_row", "padded")


def grid_cases() -> list[dict]:
    """Odd small cases, cycling masks, layouts and per-token keys over the (bits, dtype, shape) product."""
    shapes = [  # (batch, heads, token groups, G, Dk, Dv, Gv)
        (1, 1, 1, 32, 64, 64, 32), (2, 3, 2, 32, 128, 128, 32), (3, 2, 4, 32, 96, 96, 32),
        (2, 2, 3, 64, 128, 128, 64), (2, 1, 2, 128, 128, 128, 128), (1, 2, 1, 128, 64, 64, 64),
        (4, 1, 4, 16, 64, 64, 16), (2, 2, 2, 32, 72, 64, 32), (1, 3, 3, 64, 96, 96, 32),
    ]
    out, i = [], 0
    for bits in (2, 4):
        for dtype in ("bfloat16", "float16", "float32"):
            for b, h, ng, g, dk, dv, gv in shapes:
                kpt = i % 3 == 2 and dk % gv == 0 and dk % (32 // bits) == 0
                out.append(dict(kind="grid", batch=b, heads=h, tokens=ng * g, group=g, k_dim=dk, v_dim=dv,
                                v_group=gv, bits=bits, dtype=dtype, k_per_token=kpt, mask=MASKS[i % len(MASKS)],
                                layout="bthd" if i % 4 == 3 else None))
                i += 1
    return out


def llama_cases(quick: bool) -> list[dict]:
    """Decode (a static cache's flush: always a mask) and prefill shapes of Llama-3-8B (8 kv heads, d 128)."""
    out = []
    for b in (1, 8):
        for t in (32, 128):
            for bits in (2,) if quick else (2, 4):
                for g in sorted({32, t}):
                    out.append(dict(kind="decode", batch=b, heads=8, tokens=t, group=g, k_dim=128, v_dim=128,
                                    v_group=32, bits=bits, dtype="bfloat16", k_per_token=False, mask="padded",
                                    layout="bthd"))
    for bits in (2,) if quick else (2, 4):
        for g, mask in ((32, "padded"), (128, "padded"), (32, None)):
            out.append(dict(kind="prefill", batch=1, heads=8, tokens=32768, group=g, k_dim=128, v_dim=128,
                            v_group=32, bits=bits, dtype="bfloat16", k_per_token=False, mask=mask, layout="bthd"))
    return out


def case_name(c: dict) -> str:
    return (f"{c['kind']}-b{c['batch']}h{c['heads']}t{c['tokens']}-g{c['group']}-dk{c['k_dim']}dv{c['v_dim']}"
            f"-vg{c['v_group']}-{c['bits']}bit-{c['dtype']}{'-kpt' if c['k_per_token'] else ''}"
            f"-{c['mask'] or 'nomask'}{'-' + c['layout'] if c['layout'] else ''}")


def make_inputs(c: dict, device, seed: int):
    """``(k, v, valid)`` of a case, generated on ``device``."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    b, h, t, g = c["batch"], c["heads"], c["tokens"], c["group"]
    dtype = getattr(torch, c["dtype"])

    def rand(d, scale, shift):  # [B, H, T, d], in a [B, T, H, d] buffer for the "bthd" layout
        if c["layout"] == "bthd":
            x = torch.randn(b, t, h, d, generator=gen, device=device).transpose(1, 2)
        else:
            x = torch.randn(b, h, t, d, generator=gen, device=device)
        return (x * scale + shift).to(dtype)

    k, v = rand(c["k_dim"], 1.7, 0.4), rand(c["v_dim"], 1.0, 0.0)
    mask = c["mask"]
    if mask is None:
        return k, v, None
    valid = torch.rand(b, t, generator=gen, device=device) > 0.3 if mask != "padded" else \
        torch.ones(b, t, dtype=torch.bool, device=device)
    if mask == "dead_group":
        for row in range(b):
            first = (row % (t // g)) * g
            valid[row, first:first + g] = False
    elif mask == "dead_row":
        valid[-1] = False
    elif mask == "padded":  # left padding of a batch, and the first rows' sinks
        for row in range(b):
            valid[row, : (37 * row) % t] = False
    return k, v, valid


def code_mismatches(a, r, bits: int):
    """Differing codes inside int32 words (any shape): one count per bit field that differs."""
    import torch

    x = a ^ r
    fields = [(x >> (bits * s)) & ((1 << bits) - 1) for s in range(32 // bits)]
    return torch.stack(fields, dim=-1) != 0


def compare(c: dict, got, ref, valid) -> dict:
    """Code mismatches (total, and at masked slots), scale / zero bit equality."""
    import torch

    res = {"shapes_equal": all(a.shape == r.shape and a.dtype == r.dtype for a, r in zip(got, ref))}
    if not res["shapes_equal"]:
        return res
    b, t = c["batch"], c["tokens"]
    masked = None if valid is None else ~valid
    for side, (codes, scale, zero), (rc, rs, rz) in (("k", got[:3], ref[:3]), ("v", got[3:], ref[3:])):
        diff = code_mismatches(codes, rc, c["bits"])  # [..., PER]
        res[f"{side}_code_mismatches"] = int(diff.sum())
        if masked is not None and res[f"{side}_code_mismatches"]:
            if side == "k" and not c["k_per_token"]:  # [B, H, NG, KW, G, PER]: token = group * G + t
                tok = masked.view(b, 1, t // c["group"], 1, c["group"], 1)
            else:  # [B, H, T, W, PER]
                tok = masked.view(b, 1, t, 1, 1)
            res[f"{side}_code_mismatches_masked"] = int((diff & tok).sum())
        else:
            res[f"{side}_code_mismatches_masked"] = 0
        res[f"{side}_scale_equal"] = bool(torch.equal(scale.view(torch.int16), rs.view(torch.int16)))
        res[f"{side}_zero_equal"] = bool(torch.equal(zero.view(torch.int16), rz.view(torch.int16)))
    total = res["k_code_mismatches"] + res["v_code_mismatches"]
    at_masked = res["k_code_mismatches_masked"] + res["v_code_mismatches_masked"]
    scales = all(res[f"{s}_{w}_equal"] for s in "kv" for w in ("scale", "zero"))
    res["exact"] = scales and total == 0
    res["ok"] = scales and total == at_masked  # exact, or only the masked-mean caveat
    return res


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    return env


def run_case(c: dict, args, seed: int) -> dict:
    import torch

    from kvcompress.kernels import ops

    device = "cpu" if args.dry_run else "cuda"
    k, v, valid = make_inputs(c, device, seed)
    consts = (c["bits"], c["group"], c["v_group"], c["k_per_token"])
    facts = dict(bits=c["bits"], group=c["group"], v_group=c["v_group"], head_dim=c["k_dim"], v_dim=c["v_dim"],
                 k_per_token=c["k_per_token"], dtype=k.dtype)
    row = {"chosen_by_choose": ops.choose("kivi_quantize", device, **facts)}
    op = torch.ops.kvcompress.kivi_quantize.default
    if args.dry_run:  # the op refuses "triton" on CPU tensors: run its CUDA implementation (the glue) directly
        triton_call = (lambda k, v, valid: ops.CUDA_IMPLS["kivi_quantize"](k, v, valid, *consts, "triton"))
    else:
        triton_call = (lambda k, v, valid: op(k, v, valid, *consts, "triton"))
    reference_call = (lambda k, v, valid: op(k, v, valid, *consts, "reference"))
    got, ref = triton_call(k, v, valid), reference_call(k, v, valid)
    row.update(compare(c, got, ref, valid))
    if args.dry_run:
        return row
    del got, ref
    row.update(time_case(c, device, seed, (k, v, valid), reference_call, triton_call, args.reps, args.max_copies))
    return row


def time_case(c: dict, device, seed: int, first: tuple, reference_call, triton_call, reps: int,
              max_copies: int) -> dict:
    """Microseconds per call (median of ``reps``), eager and CUDA graph, rotating over distinct input copies (up to
    ``max_copies``, about 400 MB in all where they fit)."""
    from kvcompress.kernels import benchutil

    k, v, _ = first
    copies = min(benchutil.copies_for(k.numel() * k.element_size() + v.numel() * v.element_size()), max_copies)
    inputs = [first] + [make_inputs(c, device, seed + 1 + i) for i in range(copies - 1)]
    row = {"input_copies": copies}
    for impl, fn in (("reference", reference_call), ("triton", triton_call)):
        for mode in ("eager", "graph"):
            t = benchutil.time_op(fn, inputs, reps=reps, graph=mode == "graph", device=device)
            row[f"{impl}_{mode}_us"] = round(t.us, 2)
            row[f"{impl}_{mode}_method"] = t.method
    for mode in ("eager", "graph"):
        row[f"speedup_{mode}"] = round(row[f"reference_{mode}_us"] / row[f"triton_{mode}_us"], 2)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_kivi_quantize.json")
    p.add_argument("--quick", action="store_true", help="fewer decode / prefill cases (2-bit only)")
    p.add_argument("--only", default="grid,decode,prefill", help="comma-separated subset of grid,decode,prefill")
    p.add_argument("--reps", type=int, default=20, help="timed replays per measurement (median)")
    p.add_argument("--max-copies", type=int, default=32, help="most distinct input copies rotated over when timing")
    p.add_argument("--dry-run", action="store_true", help="CPU smoke test: the grid only, the kernel under the "
                   "Triton interpreter, no timings")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton's decorators run (nothing imported Triton yet)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_kivi_cuda import ensure_package  # noqa: E402  (assembles /tmp/site when kvcompress is not importable)

    ensure_package()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_kivi_quantize: needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_kivi_quantize.json"
    kinds = set(args.only.split(","))
    cases = [c for c in grid_cases() if "grid" in kinds]
    if not args.dry_run:
        cases += [c for c in llama_cases(args.quick) if c["kind"] in kinds]
    report = {"environment": environment(), "command": " ".join(sys.argv), "results": []}

    def save():
        rs = report["results"]
        report["summary"] = {"cases": len(rs), "exact": sum(r.get("exact") is True for r in rs),
                             "ok": sum(r.get("ok") is True for r in rs),
                             "not_ok": sum(r.get("ok") is False for r in rs), "errors": sum("error" in r for r in rs)}
        path.write_text(json.dumps(report, indent=1))

    print(f"{'case':72s} {'choose':9s} {'codes k/v (masked)':20s} {'s/z':4s} {'ref eager':>9s} {'tri eager':>9s} "
          f"{'ref graph':>9s} {'tri graph':>9s}  (us)", flush=True)
    for i, c in enumerate(cases):
        name = case_name(c)
        row = {"case": name, **c}
        t0 = time.perf_counter()
        try:
            row.update(run_case(c, args, seed=1000 * i + 7))
        except Exception as exc:  # one failing case never stops the others
            row.update(ok=None, error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-3000:])
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        report["results"].append(row)
        save()
        if "error" in row:
            print(f"{name:72s} ERROR {row['error'][:200]}", flush=True)
        else:
            codes = (f"{row.get('k_code_mismatches')}/{row.get('v_code_mismatches')} "
                     f"({row.get('k_code_mismatches_masked')}/{row.get('v_code_mismatches_masked')})")
            sz = "ok" if all(row.get(f"{s}_{w}_equal") for s in "kv" for w in ("scale", "zero")) else "DIFF"
            times = " ".join(f"{row.get(f'{impl}_{mode}_us', '-')!s:>9s}" for mode in ("eager", "graph")
                             for impl in ("reference", "triton"))
            print(f"{name:72s} {row['chosen_by_choose']:9s} {codes:20s} {sz:4s} {times}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    save()
    s = report["summary"]
    print(f"{s['cases']} cases: {s['exact']} exact, {s['ok']} ok (exact or masked-mean caveat only), "
          f"{s['not_ok']} not ok, {s['errors']} errors -> {path}")
    return 0 if s["not_ok"] == 0 and s["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
