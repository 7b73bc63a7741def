"""The opt-in cache memory (``kernels/vmm.py``, ``KVCOMPRESS_CACHE_MEMORY=vmm``): the setting, the allocator library's
build, where a cache's buffers live; on a GPU (marker ``gpu``) the pool itself against PyTorch's allocator."""

from __future__ import annotations

import copy
import ctypes
import subprocess
import sys

import pytest
import torch

from kvcompress.kernels import vmm


@pytest.fixture
def memory_setting(monkeypatch):
    """Set ``KVCOMPRESS_CACHE_MEMORY`` for one test (the module reads it once: its record is cleared around it)."""
    saved = dict(vmm._STATE)

    def use(value):
        monkeypatch.setenv("KVCOMPRESS_CACHE_MEMORY", value)
        vmm._STATE.pop("setting", None)

    yield use
    vmm._STATE.clear()
    vmm._STATE.update(saved)


def test_setting_defaults_to_torch_and_refuses_other_values(memory_setting, monkeypatch):
    monkeypatch.delenv("KVCOMPRESS_CACHE_MEMORY", raising=False)
    vmm._STATE.pop("setting", None)
    assert vmm.setting() == "torch"
    memory_setting(" VMM ")
    assert vmm.setting() == "vmm"
    memory_setting("cuda")
    with pytest.raises(ValueError, match=r"KVCOMPRESS_CACHE_MEMORY must be one of torch, vmm, got 'cuda'"):
        vmm.setting()


def test_cpu_memory_is_a_context_that_does_nothing(memory_setting):
    memory_setting("vmm")
    mem = vmm.memory("cpu")
    assert not mem.mapped and mem.pool is None
    with mem():
        t = torch.zeros(3)
    assert t.device.type == "cpu"
    assert copy.deepcopy(mem) is mem


def test_library_builds_and_finds_the_driver_only_where_there_is_one():
    """The allocator library compiles with the C compiler and Triton's cuda.h, exports what PyTorch's pluggable
    allocator loads, and says it is ready exactly where libcuda.so.1 can be opened (an independent check)."""
    if vmm.include_dir() is None or vmm.compiler() is None:
        pytest.skip("needs Triton's cuda.h and a C compiler")
    lib = ctypes.CDLL(vmm.build())
    for name in ("kvc_vmm_malloc", "kvc_vmm_free", "kvc_vmm_ready", "kvc_vmm_granularity"):
        assert hasattr(lib, name), name
    try:
        ctypes.CDLL("libcuda.so.1")
        driver = True
    except OSError:
        driver = False
    assert lib.kvc_vmm_ready() == int(driver)
    if not driver:  # nothing can be allocated without the driver: a null pointer, never a crash
        lib.kvc_vmm_malloc.restype = ctypes.c_void_p
        assert lib.kvc_vmm_malloc(ctypes.c_ssize_t(1 << 20), 0, None) is None


def test_static_layer_and_its_copies_carry_their_memory():
    """A static layer chooses its memory when it allocates (the default: PyTorch's allocator, nothing mapped), and a
    deep copy of the layer (benchmarks rotate copies; users copy prompt caches) shares it."""
    from kvcompress.kernels import benchutil as bu

    shape = bu.SHAPES[1]
    layer = bu.build_static_layer("none", shape, 2, 48, torch.device("cpu"))
    assert layer.buffer_memory is not None and not layer.buffer_memory.mapped
    twin = copy.deepcopy(layer)
    assert twin.buffer_memory is layer.buffer_memory and twin.k.data_ptr() != layer.k.data_ptr()
    assert torch.equal(twin.k, layer.k)


# ----------------------------------------------------------------------------- GPU

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@on_gpu
def test_pool_holds_buffers_in_mapped_memory_and_gives_it_back(memory_setting):
    memory_setting("vmm")
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info(dev)[0]
    used0 = torch.cuda.memory_allocated(dev)
    mem = vmm.memory(dev)
    assert mem.mapped, "the allocator library did not load on this GPU"
    n = 300 * (1 << 20) + 12345  # not a multiple of the 2 MB granule
    with mem():
        t = torch.empty(n, dtype=torch.uint8, device=dev)
    outside = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    assert torch.cuda.memory_allocated(dev) - used0 >= n + (1 << 20)  # PyTorch's accounting sees the pool's buffer
    assert torch.cuda.mem_get_info(dev)[0] <= free0 - n
    t.copy_(torch.arange(n, device=dev, dtype=torch.int64).remainder_(251).to(torch.uint8))
    g = 2 << 20
    for i in (0, g - 1, g, 150 * g + 7, n - 1):  # across granules, to the last byte
        assert int(t[i]) == i % 251, i
    seg = [s for s in torch.cuda.memory_snapshot() if s["address"] <= t.data_ptr() < s["address"] + s["total_size"]]
    assert seg and seg[0]["segment_pool_id"] == tuple(mem.pool.id), "the buffer is not in the owner's pool"
    del t, outside, mem
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info(dev)[0] >= free0 - (64 << 20), "the pool's memory was not given back"


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("op", ["none", "kivi2-static", "leank70-kivi2"])
def test_static_read_in_mapped_memory_equals_the_default(op, memory_setting):
    """The same layer built under both settings (same generator) reads bit-identically."""
    from kvcompress.kernels import benchutil as bu

    dev = torch.device("cuda")
    shape = bu.SHAPES[0]
    out = {}
    for value in ("torch", "vmm"):
        memory_setting(value)
        gen = torch.Generator(device=dev).manual_seed(3)
        layer = bu.build_static_layer(op, shape, 2, 3000 + 37, dev, gen)
        assert layer.buffer_memory.mapped == (value == "vmm")
        q = torch.randn(2, shape.q_heads, 1, shape.head_dim, device=dev, dtype=torch.float16,
                        generator=torch.Generator(device=dev).manual_seed(4))
        out[value] = bu.static_read(layer, q, shape.head_dim ** -0.5)
    assert torch.equal(out["torch"], out["vmm"])


@pytest.mark.gpu
@on_gpu
def test_paged_pool_grows_in_mapped_memory(memory_setting):
    """The dynamic paged pool keeps its pages in its own mapped memory as it grows; reads equal the default's."""
    from kvcompress.kernels.paged import bench as paged_bench

    dev = torch.device("cuda")
    out = {}
    for value in ("torch", "vmm"):
        memory_setting(value)
        gen = torch.Generator(device=dev).manual_seed(5)
        store, view = paged_bench.paged_pool(2, 8, 4096, 128, dev, gen)
        assert store.buffer_memory.mapped == (value == "vmm")
        q = torch.randn(2, 8, 4, 128, device=dev, dtype=torch.float16,
                        generator=torch.Generator(device=dev).manual_seed(6))
        out[value] = view.attention_partial(q, 128 ** -0.5)
    assert all(torch.equal(a, b) for a, b in zip(out["torch"], out["vmm"]))
