"""The ops one decode read of a static layer issues, on the CPU (no GPU): on CUDA each aten op is a kernel launch and
each ``kvcompress`` op one kernel (plus its split merge where the read splits).

Builds each static stack of the kernel benchmark (``kvcompress.kernels.benchutil.STATIC_OPS``) at a tiny shape
(16 query / 8 kv heads, head dim 32, 200 tokens), sets the read kernels a CUDA layer chooses (the registered ops
then run their CPU implementations through the CUDA control flow), runs ``StaticLayer._read`` once under a
``TorchDispatchMode`` and prints every op it dispatches that launches work on a GPU (views, ``empty`` and other
metadata-only ops are left out).  ``--cuda-kivi`` takes the KIVI CUDA kernel's choice for the quantized middles (its
one-launch buffer read needs CUDA tensors, so on the CPU such a read is still two ops and a merge).

    python benchmarks/read_ops.py [--cuda-kivi] [--ops none,lowrank]
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvcompress.kernels import benchutil

#: aten ops that launch nothing (views, allocation, metadata)
NO_LAUNCH = {"view", "_unsafe_view", "t", "transpose", "expand", "as_strided", "select", "slice", "unsqueeze",
             "squeeze", "alias", "detach", "empty", "empty_strided", "permute", "reshape", "_reshape_alias",
             "lift_fresh", "split", "unbind", "narrow", "new_empty", "new_empty_strided", "empty_like", "diagonal",
             "view_as", "expand_as", "sym_size", "sym_stride", "dim", "size"}
SHAPE = benchutil.Shape("tiny", 16, 8, 32)
REGIONS = {"sinks": 4, "window": 16, "flush": 32}


class _Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "kvcompress" or name not in NO_LAUNCH:
            self.ops.append(f"{func.namespace}::{name}")
        return func(*args, **(kwargs or {}))


def read_ops(op: str, cuda_kivi: bool = False, batch: int = 2, tokens: int = 200) -> list[str]:
    """The launching ops of one decode read of stack ``op``."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(batch, SHAPE.kv_heads, tokens, SHAPE.head_dim, generator=g).half() for _ in range(2))
    q = torch.randn(batch, SHAPE.q_heads, 1, SHAPE.head_dim, generator=g).half()
    layer = benchutil.build_static_layer(op, SHAPE, batch, tokens, "cpu", regions=REGIONS, kv=(k, v),
                                         chunk_bytes=64 * batch * SHAPE.kv_heads * SHAPE.head_dim * 2)
    # the choices of a CUDA layer (ops.choose on a GPU with Triton, and nvcc for the KIVI kernel)
    layer.kernels = {"lanes_partial": "triton", "gather_partial": "triton", "merge_partials": "triton"}
    kivi = "cuda" if cuda_kivi else "triton"
    if layer.middle is not None and hasattr(layer.middle, "kernels"):
        layer.middle.kernels = [kivi] * len(layer.middle.kernels)
    if getattr(layer.middle, "merged", None) is not None:
        layer.middle.lanes_kernel = kivi
    with _Log() as log:
        benchutil.static_read(layer, q, SHAPE.head_dim ** -0.5)
    return log.ops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(benchutil.STATIC_OPS))
    ap.add_argument("--cuda-kivi", action="store_true")
    args = ap.parse_args(argv)
    print("| read | launches | ops |\n|---|---|---|")
    for op in args.ops.split(","):
        ops = read_ops(op, args.cuda_kivi)
        print(f"| {op} | {len(ops)} | {', '.join(ops)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
