"""Cache buffers in memory mapped from the CUDA driver's physical allocations (``KVCOMPRESS_CACHE_MEMORY=vmm``).

Why.  The same decode read of the same cache ran 13-19 % slower on an H100 depending on which large allocations the
process had made before the cache was allocated (docs/results.md, sessions 39 and 46): paged dense Llama B16 / 128k
2760 -> 3272 us, the empty stack Llama B64 / 32k 2715 -> 3213 us, KIVI-2 Llama B64 / 32k 609 -> 686-692 us, while SDPA
did not move.  Under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (PyTorch then maps its segments from
``cuMemCreate`` granules) the slow cases went away (session 39), and with only the cache's own allocations in a pool
of such memory they did too (``benchmarks/gpu_vmm_probe.py``, session 46: 12 of 12 reads at their fast time, against
5 of 24 slow under the default allocator in the same process).  That setting is process-wide and kvcompress does not
set it; this module gives a cache's buffers that memory without touching the rest of the process.

How.  :func:`memory` returns a context manager for an owner (a static layer, a paged pool): on CUDA with
``KVCOMPRESS_CACHE_MEMORY=vmm`` it is ``torch.cuda.use_mem_pool`` of the owner's own ``torch.cuda.MemPool`` whose
segments come from ``kernels/vmm.c`` (one ``cuMemCreate`` allocation at the device's recommended granularity mapped
onto a reserved address range per segment; libcuda opened at run time), built once with the C compiler Triton itself
needs (and the ``cuda.h`` Triton ships) into ``~/.cache/kvcompress/vmm``.  PyTorch's allocator keeps its accounting
(``torch.cuda.memory_allocated`` counts these buffers) and its caching within the pool; the pool goes with its owner.
Anywhere else (CPU, the setting ``torch``, the default; or a build that fails: one warning) it is a context that does
nothing.  The setting is read once.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("vmm.c")
SETTINGS = ("torch", "vmm")
_LOCK = threading.Lock()
_STATE: dict = {}


def setting() -> str:
    """``KVCOMPRESS_CACHE_MEMORY`` (read once): ``torch`` (default: PyTorch's caching allocator) or ``vmm``."""
    with _LOCK:
        if "setting" not in _STATE:
            value = os.environ.get("KVCOMPRESS_CACHE_MEMORY", "torch").strip().lower() or "torch"
            if value not in SETTINGS:
                raise ValueError(f"KVCOMPRESS_CACHE_MEMORY must be one of {', '.join(SETTINGS)}, got {value!r}")
            _STATE["setting"] = value
        return _STATE["setting"]


def cache_dir() -> Path:
    root = os.environ.get("KVCOMPRESS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvcompress")
    return Path(root) / "vmm"


def include_dir() -> Path | None:
    """The directory of the ``cuda.h`` Triton ships (None without Triton's NVIDIA backend)."""
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    return path if (path / "cuda.h").is_file() else None


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc`` / ``gcc`` / ``clang`` on the path (as Triton looks for its own)."""
    cc = os.environ.get("CC")
    if cc:
        return cc
    return next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def build_command(out: str, include: Path) -> list[str]:
    return [compiler() or "cc", "-O2", "-shared", "-fPIC", "-std=c99", f"-I{include}", "-o", out, str(SOURCE),
            "-ldl", "-lpthread"]


def build() -> str:
    """Compile ``vmm.c`` (or find it in the cache); returns the library's path.  Raises ``RuntimeError`` with the
    compiler's output where it cannot be built."""
    include = include_dir()
    if include is None:
        raise RuntimeError("kvcompress' cache memory needs the cuda.h that Triton's NVIDIA backend ships")
    if compiler() is None:
        raise RuntimeError("kvcompress' cache memory needs a C compiler (cc, gcc or clang; or set CC)")
    tag = hashlib.sha256(SOURCE.read_bytes() + (include / "cuda.h").read_bytes()[:4096]).hexdigest()[:16]
    path = cache_dir() / f"libkvc_vmm_{tag}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        cmd = build_command(tmp, include)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            os.unlink(tmp)
            raise RuntimeError(f"building kvcompress' cache memory failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        os.replace(tmp, path)
    return str(path)


def _allocator():
    """The pluggable allocator over the built library (once per process); None where it cannot work, with one
    warning that says what to do."""
    with _LOCK:
        if "allocator" in _STATE:
            return _STATE["allocator"]
        alloc = None
        try:
            path = build()
            lib = ctypes.CDLL(path)
            lib.kvc_vmm_ready.restype = ctypes.c_int
            if not lib.kvc_vmm_ready():
                raise RuntimeError("libcuda.so.1 does not offer the virtual memory functions")
            alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "kvc_vmm_malloc", "kvc_vmm_free")
        except Exception as exc:  # noqa: BLE001 - the cache then uses PyTorch's allocator, as by default
            warnings.warn(f"KVCOMPRESS_CACHE_MEMORY=vmm: {exc}; the cache uses PyTorch's allocator instead "
                          "(unset KVCOMPRESS_CACHE_MEMORY to silence this)", RuntimeWarning, stacklevel=3)
        _STATE["allocator"] = alloc
        return alloc


class Memory:
    """Where one owner's buffers live (:func:`memory`): ``with owner_memory:`` around their allocations."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pool = None
        if self.device.type == "cuda" and setting() == "vmm":
            alloc = _allocator()
            if alloc is not None:
                with torch.cuda.device(self.device):
                    self.pool = torch.cuda.MemPool(alloc.allocator())

    def __deepcopy__(self, memo):  # a copied cache shares its owner's memory (its copies allocate where they are made)
        return self

    def __copy__(self):
        return self

    @property
    def mapped(self) -> bool:
        """Whether allocations in the context come from the driver-mapped pool."""
        return self.pool is not None

    def __call__(self):
        if self.pool is None:
            return contextlib.nullcontext()
        return _in_pool(self.pool, self.device)


@contextlib.contextmanager
def _in_pool(pool, device: torch.device):
    with torch.cuda.device(device), torch.cuda.use_mem_pool(pool, device):
        yield


def memory(device: torch.device | str) -> Memory:
    """The memory of one owner's buffers on ``device`` (decided here, once: the pool, or nothing)."""
    return Memory(torch.device(device))
