"""Is the large-pool slowdown the memory's page mapping?  (issue 19; docs/results.md "Session 39" / "Session 46")

Session 39 found the same paged / dense / KIVI read 15-19 % slower depending on which large allocations the process
made before it, and fast in every order under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (PyTorch then maps
its segments from ``cuMemCreate`` granules).  This probe runs ``benchutil`` cases three times in one process, in the
grid's op order (SDPA's copies first):

1. ``default``: the caching allocator as the grid runs it;
2. ``vmm``: every allocation of the case in a private ``torch.cuda.MemPool`` whose segments come from a small
   allocator built here (``cuMemAddressReserve`` + ``cuMemCreate`` at the device's recommended granularity +
   ``cuMemMap``: one physical allocation per segment, mapped in 2 MB granules); the process's other memory unchanged;
3. ``default-again``: the default allocator once more, after the pool is gone (is it just the order?).

If round 2 is fast where rounds 1 and 3 are slow, the slowdown is the mapping of the segments cudaMalloc hands out
late in a process, and a cache can avoid it by allocating its buffers from such a pool.  (Session 46: round 2 was
fast at all 12 reads here, but a cache memory built on it was still slow at some reads in a two-process A/B and was
reverted; docs/results.md "Session 46".)  CUDA only; needs nvcc and libcuda (the device image has both)::

    python benchmarks/gpu_vmm_probe.py --out OUT [--shapes llama3-8b:16:128k,...] [--ops sdpa,none,paged-dense]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

VMM_SOURCE = r"""
#include <cuda.h>
#include <sys/types.h>
#include <stddef.h>

static size_t granule(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t g = 0;
  if (cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS || g == 0)
    g = 2u << 20;
  return g;
}

extern "C" void* kvc_vmm_malloc(ssize_t size, int device, void* stream) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  const size_t g = granule(device);
  const size_t n = ((size_t)size + g - 1) / g * g;
  CUdeviceptr ptr = 0;
  if (cuMemAddressReserve(&ptr, n, g, 0, 0) != CUDA_SUCCESS) return 0;
  CUmemGenericAllocationHandle h;
  if (cuMemCreate(&h, n, &prop, 0) != CUDA_SUCCESS) { cuMemAddressFree(ptr, n); return 0; }
  if (cuMemMap(ptr, n, 0, h, 0) != CUDA_SUCCESS) { cuMemRelease(h); cuMemAddressFree(ptr, n); return 0; }
  cuMemRelease(h);  // the mapping holds the memory until it is unmapped
  CUmemAccessDesc acc = {};
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = device;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (cuMemSetAccess(ptr, n, &acc, 1) != CUDA_SUCCESS) { cuMemUnmap(ptr, n); cuMemAddressFree(ptr, n); return 0; }
  return (void*)ptr;
}

extern "C" void kvc_vmm_free(void* p, ssize_t size, int device, void* stream) {
  const size_t g = granule(device);
  const size_t n = ((size_t)size + g - 1) / g * g;
  cuStreamSynchronize((CUstream)stream);
  cuMemUnmap((CUdeviceptr)p, n);
  cuMemAddressFree((CUdeviceptr)p, n);
}
"""


def build_vmm(workdir: str) -> str:
    src = os.path.join(workdir, "kvc_vmm.cu")
    lib = os.path.join(workdir, "libkvc_vmm.so")
    with open(src, "w") as fh:
        fh.write(VMM_SOURCE)
    nvcc = os.environ.get("NVCC", "nvcc")
    stubs = [f"-L{d}" for d in ("/usr/local/cuda/lib64/stubs", "/usr/local/cuda/targets/x86_64-linux/lib/stubs")
             if os.path.isdir(d)]
    subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", "-o", lib, src, *stubs, "-lcuda"], check=True)
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="llama3-8b:16:128k,llama3-8b:64:32k,smollm2-135m:64:128k")
    ap.add_argument("--ops", default="sdpa,none,paged-dense,kivi2")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from kvcompress.kernels import benchutil as bu

    os.makedirs(args.out, exist_ok=True)
    lib = build_vmm(tempfile.mkdtemp())
    alloc = torch.cuda.memory.CUDAPluggableAllocator(lib, "kvc_vmm_malloc", "kvc_vmm_free")
    dev = torch.device("cuda")
    ops = args.ops.split(",")
    rows = []
    shapes = {s.model: s for s in bu.SHAPES}
    for spec in args.shapes.split(","):
        model, b, ctx = spec.split(":")
        b, ctx = int(b), int(ctx.rstrip("k")) * 1024
        for mode in ("default", "vmm", "default-again"):
            got: list[dict] = []
            if mode == "vmm":
                pool = torch.cuda.MemPool(alloc.allocator())
                with torch.cuda.use_mem_pool(pool):
                    bu._bench_case(shapes[model], b, ctx, dev, got, ops)
                del pool
            else:
                bu._bench_case(shapes[model], b, ctx, dev, got, ops)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            for r in got:
                r["alloc_mode"] = mode
                print(f"{spec} {mode:14s} {r['op']:12s} {r.get('latency_us', float('nan')):10.1f} us "
                      f"{r.get('speedup_vs_sdpa', float('nan')):6.2f}x {r.get('method', r.get('error', ''))}",
                      flush=True)
            rows += got
            with open(os.path.join(args.out, "vmm_probe.json"), "w") as fh:
                json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
