"""The PyTorch reference partials read many query rows (a prefill chunk over a long cache) in row chunks that
bound the score tensor (``kernels.attention.reference.SCORE_ELEMENTS``): the chunked result must equal the
unchunked one (to float32 rounding: a matmul over fewer rows may round differently; rows that see nothing stay
-inf / 0), for every mask shape the callers pass, soft-cap included, and the KIVI reference partial."""

from __future__ import annotations

import pytest
import torch

from kvcompress.kernels.attention import reference
from kvcompress.kernels.kivi.reference import PackedKV, kivi_attention_partial, quantize_keys, quantize_values


def _same(a, b):
    (o1, l1), (o2, l2) = a, b
    assert torch.equal(torch.isinf(l1), torch.isinf(l2))
    torch.testing.assert_close(o1, o2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(l1, l2, atol=1e-6, rtol=1e-6)


def _both(fn, monkeypatch):
    full = fn()
    monkeypatch.setattr(reference, "SCORE_ELEMENTS", 2 * 3 * 40)  # 1 row per chunk here (b 2, h 3, t 40)
    assert reference.rows_per_chunk(2, 3, 37, 40) == 1
    chunked = fn()
    return full, chunked


@pytest.mark.parametrize("mask_kind", ["none", "per-row", "broadcast-rows", "2d"])
@pytest.mark.parametrize("softcap", [None, 0.7])
def test_dense_partial_in_row_chunks_equals_unchunked(monkeypatch, mask_kind, softcap):
    g = torch.Generator().manual_seed(0)
    b, h, m, t, d = 2, 3, 37, 40, 16
    q, k, v = (torch.randn(b, h, n, d, generator=g) for n in (m, t, t))
    mask = {"none": None, "per-row": torch.rand(b, 1, m, t, generator=g) > 0.3,
            "broadcast-rows": torch.rand(b, 1, 1, t, generator=g) > 0.3,
            "2d": torch.rand(m, t, generator=g) > 0.3}[mask_kind]
    if mask is not None:
        mask[..., 0, :] = False  # a row that sees nothing: lse -inf, zero output
    _same(*_both(lambda: reference.partial_attention(q, k, v, mask, 0.25, softcap), monkeypatch))
    assert reference.rows_per_chunk(b, h, 1, t) == 1  # a decode step is one chunk whatever the bound


def test_kivi_partial_in_row_chunks_equals_unchunked(monkeypatch):
    g = torch.Generator().manual_seed(1)
    b, h, m, t, d = 2, 3, 37, 40, 32
    k, v = torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)
    valid = torch.rand(b, t, generator=g) > 0.2
    packed = PackedKV(2, 8, *quantize_keys(k, 2, 8), *quantize_values(v, 2, 32), valid)
    q = torch.randn(b, h, m, d, generator=g)
    _same(*_both(lambda: kivi_attention_partial(q, packed, 0.2), monkeypatch))
