"""Per-kernel latency with pytest-benchmark (small shapes; nothing asserts a wall time).

Run:  .venv/bin/python -m pytest benchmarks/test_kernels.py --benchmark-only -q
On the CPU this times the PyTorch references (the Triton kernels need a GPU); on a CUDA
machine it adds the fused KIVI kernel and the grouped LeanK kernel.  For cold-L2 GPU numbers over the full grid of
shapes use ``python -m kvcompress.kernels.benchutil`` (or ``kvcompress bench --kernels``).
"""

import pytest
import torch

from kvcompress.kernels import benchutil
from kvcompress.kernels.attention.reference import partial_attention
from kvcompress.kernels.kivi.reference import kivi_attention_partial

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH, KV_HEADS, GROUP, HEAD_DIM, CTX = 1, 3, 3, 64, 2048  # SmolLM2-135M attention shape, 2k tokens
SCALE = HEAD_DIM ** -0.5
GROUP_NAME = f"one decode step of attention, B={BATCH}, {KV_HEADS * GROUP}/{KV_HEADS} heads, d={HEAD_DIM}, " \
             f"ctx={CTX} ({DEVICE})"


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.fixture(scope="module")
def dense():
    return benchutil.dense_inputs(BATCH, KV_HEADS, CTX, HEAD_DIM, GROUP, torch.device(DEVICE))


@pytest.fixture(scope="module", params=[2, 4], ids=["kivi2", "kivi4"])
def packed(request):
    return benchutil.kivi_inputs(BATCH, KV_HEADS, CTX, HEAD_DIM, request.param, 32, 32, GROUP, torch.device(DEVICE))


def test_sdpa_fp16_cache(benchmark, dense):
    q, k, v = dense
    if DEVICE == "cpu":
        q, k, v = q.float(), k.float(), v.float()  # fp16 SDPA on the CPU is not a meaningful baseline
    benchmark.group = GROUP_NAME
    benchmark(lambda: (torch.nn.functional.scaled_dot_product_attention(q, k, v), _sync()))


def test_dense_reference(benchmark, dense):
    q, k, v = dense
    benchmark.group = GROUP_NAME
    benchmark(lambda: (partial_attention(q, k, v, None, SCALE), _sync()))


def test_kivi_reference(benchmark, packed):
    q, p = packed
    benchmark.group = GROUP_NAME
    benchmark(lambda: (kivi_attention_partial(q, p, SCALE), _sync()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel needs CUDA (the interpreter is not timed)")
def test_kivi_triton(benchmark, packed):
    from kvcompress.kernels.kivi.triton_kernel import kivi_attention_partial as fused

    q, p = packed
    fused(q, p, SCALE)
    benchmark.group = GROUP_NAME
    benchmark(lambda: (fused(q, p, SCALE), _sync()))


@pytest.fixture(scope="module", params=[50, 70], ids=["leank50", "leank70"])
def leank(request):
    # SmolLM2 shape: 1024 full-precision tokens + a pruned middle of CTX - 1024 tokens (benchutil.LEANK_COUNTS)
    return benchutil.leank_inputs(BATCH, KV_HEADS, CTX - benchutil.LEANK_FP_TOKENS, HEAD_DIM, GROUP, request.param,
                                  torch.device(DEVICE))


def test_leank_reference(benchmark, leank):
    from kvcompress.kernels.leank.reference import grouped_partial_attention

    q, lanes = leank
    benchmark.group = GROUP_NAME
    benchmark(lambda: (grouped_partial_attention(q, lanes, SCALE), _sync()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grouped kernel needs CUDA (the interpreter is not timed)")
def test_leank_triton(benchmark, leank):
    from kvcompress.kernels.leank.triton_kernel import grouped_partial_attention

    q, lanes = leank
    grouped_partial_attention(q, lanes, SCALE)
    benchmark.group = GROUP_NAME
    benchmark(lambda: (grouped_partial_attention(q, lanes, SCALE), _sync()))
