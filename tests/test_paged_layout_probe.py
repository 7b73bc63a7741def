"""benchmarks/paged_layout_probe.py: its pools hold the tokens SDPA reads, laid out as each variant says."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import paged_layout_probe  # noqa: E402


def test_every_pool_reads_the_tokens_sdpa_reads():
    rows = paged_layout_probe.probe("smollm2-135m:2:256", "p16,p16-decode,p64,p16-heads,p16-decode-heads", "cpu",
                                    time_reads=False, log=lambda line: None)
    assert [r["read"] for r in rows] == ["sdpa", "p16", "p16-decode", "p64", "p16-heads", "p16-decode-heads"]
    for r in rows[1:]:  # the same output as SDPA on the contiguous tokens, up to fp16 rounding
        assert r["err"] < 2e-3, r
    assert [r["pages"] for r in rows[1:]] == [256 // 16, 256 // 16, 256 // 64, 256 // 16, 256 // 16]


def test_the_decode_fill_interleaves_rows_page_by_page():
    import torch

    from kvcompress.kernels.paged import bench as paged_bench

    chunk = {"p16": paged_bench.FILL_CHUNK_BYTES, "p16-decode": 2 * 3 * 64 * 2 * 16}
    tables = {}
    for var, c in chunk.items():
        _, view = paged_bench.paged_pool(2, 3, 64, 64, "cpu", torch.Generator().manual_seed(0), page=16,
                                         chunk_bytes=c)
        tables[var] = view.table.tolist()
    assert tables["p16"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # one append: each row's pages in one run
    assert tables["p16-decode"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # a page per row per append


def test_an_unknown_variant_is_named():
    with pytest.raises(ValueError, match=r"unknown \['p32'\]; allowed: p16, p16-decode, p64"):
        paged_layout_probe.probe("smollm2-135m:1:64", "p32", "cpu", time_reads=False, log=lambda line: None)
