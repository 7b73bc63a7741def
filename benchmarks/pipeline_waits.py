"""What each step of a pipelined Triton decode read waits on, from its sm_90 TTGIR, without a GPU.

The paged read and the DoubleSparse gathers are recorded on CPU tensors and compiled for sm_90 as
``benchmarks/read_occupancy.py`` does (``tests/triton_offline.py``).  For each build the script reads the steady-state
loop of the TTGIR: the ``ttg.async_wait`` counts (``num = 0``: every copy in flight lands before the step computes;
``num = 2``: the next steps' copies stay in flight) and the plain ``tt.load`` ops left in it (a synchronous load
whose result a copy's mask or address needs delays that copy); then registers and shared memory per program
(``read_occupancy.usage``).  Variants set the opt-in constexprs (session 37): the paged kernel's ``LATE``
(``valid_late``) and ``VBLOCK`` (``valid_block``), the gathers' ``ISTEPS`` (``index_steps``) and ``BK``.

Session 38 added what a step costs in machine code: the dot operands' ``kWidth`` (TTGIR; 4 where a byte-wide value
is behind an operand - the paged kernel's K / V copies are masked by its byte flags - so the tiles leave shared memory
by ``LDS.64`` and register moves, 2 with ``ldmatrix``) and, from the cubin disassembled by the ``nvdisasm`` Triton
ships, the innermost loop's instructions and some of its opcodes - beside the lanes kernel's empty-stack read, which
streams the same bytes (``lanes-none``).

    PYTHONPATH=/tmp/t36 python benchmarks/pipeline_waits.py   (Triton 3.6, as on the lent GPUs)
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

#: (read, variant) rows: Llama heads, batch 16 (the constexprs a grid launch at those heads compiles)
ROWS = (("paged", {}), ("paged", {"LATE": True}), ("paged", {"VBLOCK": True}), ("paged", {"num_stages": 2}),
        ("paged", {"num_stages": 2, "VBLOCK": True}), ("lanes-none", {}),
        ("ds-shared", {}), ("ds-shared", {"ISTEPS": 4}), ("ds-shared", {"ISTEPS": 8, "BK": 64}),
        ("ds-per-row", {}), ("ds-per-row", {"ISTEPS": 4}))
#: opcodes counted in a step (``LDSM``: ldmatrix; ``LDS``: other shared loads; ``LDG``: synchronous global loads)
STEP_OPS = ("HMMA", "LDSM", "LDS", "LDGSTS", "LDG", "IMAD", "BAR")


def gather_launch(shared: bool, batch: int = 16, heads: int = 8, rows: int = 4, dim: int = 128):
    """The tensor-core DoubleSparse gather's launch (group-shared or per-row selections of 256 indices, no padding
    flags, as benchutil's ``ds*`` reads call it)."""
    import torch

    from kvcompress.kernels.attention import triton_shared
    from kvcompress.kernels.doublesparse import triton_kernel as ds
    from read_occupancy import _record

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(batch, heads, rows, dim, generator=gen).half()
    k, v = (torch.randn(batch, heads, 4096, dim, generator=gen).half() for _ in range(2))
    index = torch.randint(0, 4096, (batch, heads, 1 if shared else rows, 256), generator=gen, dtype=torch.int32)
    if shared:
        index = index.expand(batch, heads, rows, 256)
    names = [(ds, "_gather_shared_kernel"), (ds, "_gather_rows_dot_kernel"), (triton_shared, "_combine_tiles_kernel")]
    return _record(names, lambda: ds.gather_partial_attention(q, k, v, None, index, 0.1, splits=2))[0]


def dot_kwidths(ttgir: str) -> list[int]:
    """The ``kWidth`` of every dot operand layout in the TTGIR (sorted, each once)."""
    return sorted({int(w) for w in re.findall(r"dot_op<\{opIdx = \d, parent = #mma, kWidth = (\d+)\}>", ttgir)})


def sass_step(sass: str) -> dict:
    """The innermost loop of disassembled SASS (``nvdisasm -c``): the backward branch whose target label comes last,
    its instruction count and the :data:`STEP_OPS` opcodes in it (predicates and modifiers ignored)."""
    labels, ins = {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ins)
        elif re.search(r"/\*[0-9a-f]{4,}\*/", line) and re.search(r"[A-Z]{2,}", line):
            ins.append(line)
    loops = [(labels[b.group(1)], i) for i, line in enumerate(ins)
             if (b := re.search(r"BRA.*?\.(L_x_\d+)", line)) and labels.get(b.group(1), i) < i]
    if not loops:
        return {"instructions": 0, **{op: 0 for op in STEP_OPS}}
    start, end = max(loops)
    counts = {op: 0 for op in STEP_OPS}
    for line in ins[start:end + 1]:
        text = re.sub(r"^@!?U?P[T0-9]+\s+", "", re.sub(r"/\*.*?\*/", "", line).strip())
        op = re.match(r"([A-Z][A-Z0-9_]+)", text)
        if op and op.group(1) in counts:
            counts[op.group(1)] += 1
    return {"instructions": end - start + 1, **counts}


def disassemble(cubin: bytes) -> str | None:
    """``nvdisasm -c`` of a cubin with the disassembler Triton ships (``None`` where it is missing)."""
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout


def loop_facts(ttgir: str) -> dict:
    """The steady-state loop's waits and plain loads: the text after the last ``scf.for`` that holds an
    ``async_wait`` with operands (the pipelined loop; the prologue and the epilogue's drain are outside it)."""
    loops = [m.start() for m in re.finditer(r"scf\.for", ttgir)]
    body = next((ttgir[s:] for s in reversed(loops) if re.search(r"async_wait %", ttgir[s:])), ttgir)
    body = body[:body.find("ttg.async_wait {num = 0")] if "ttg.async_wait {num = 0" in body else body
    return {"waits": sorted(int(n) for n in re.findall(r"async_wait %[^{]*\{num = (\d+)", body)),
            "plain_loads": len(re.findall(r"= tt\.load ", body))}


def main(argv=None) -> int:
    from read_occupancy import lanes_launches, paged_launches, usage
    from triton_offline import Launch, compile_launch

    from kvcompress.kernels.benchutil import SHAPES

    lanes = [x for x in lanes_launches("none", SHAPES[0], 16) if "_lanes_kernel" in str(getattr(x.fn, "fn", x.fn))]
    base = {"paged": paged_launches(SHAPES[0], 16)[0], "lanes-none": lanes[0],
            "ds-shared": gather_launch(True), "ds-per-row": gather_launch(False)}
    print("| read | variant | async_wait num in the loop | plain loads in the loop | registers | shared B | dot kWidth "
          "| SASS a step | " + " | ".join(STEP_OPS) + " |")
    print("|---" * (8 + len(STEP_OPS)) + "|")
    for read, variant in ROWS:
        launch = base[read]
        kwargs = {**launch.kwargs, **variant}
        if read == "lanes-none" and "num_stages" not in variant:  # the depth of the paged rows' launch
            kwargs["num_stages"] = 3
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = compile_launch(Launch(launch.fn, launch.args, kwargs))
        facts, got = loop_facts(built.asm["ttgir"]), usage(built)
        sass = disassemble(built.asm["cubin"])
        step = sass_step(sass) if sass else None
        cols = [str(step["instructions"])] + [str(step[op]) for op in STEP_OPS] if step else ["-"] * (1 + len(STEP_OPS))
        print(f"| {read} | {variant or 'default'} | {facts['waits']} | {facts['plain_loads']} | {got['registers']} | "
              f"{got['shared_bytes']} | {dot_kwidths(built.asm['ttgir'])} | " + " | ".join(cols) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
