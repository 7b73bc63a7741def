"""Low-rank keys: projected middle against the dense model and an independent K U U^T oracle."""

import subprocess
import sys

import pytest
import torch

import kvcompress
from kvcompress.calibration.lowrank import (BasisFileError, LowRankSettings, choose_ranks, energy_kept,
                                            kv_spectra, load_basis, save_basis)
from kvcompress.calibration.masks import config_hash, rope_mask, save_mask
from kvcompress.errors import ConfigError, KVCompressError
from kvcompress.stack import parse_stack
from models import tiny_model
from reference import causal_visibility, decode_chunks, masked_logits, middle_oracle_logits, streamed_logits

SINKS, RECENT, FLUSH = 3, 24, 8


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def spectrum(model):
    """PCA of the tiny model's post-RoPE keys and values over random token windows (head_dim 16)."""
    tokens = torch.randint(1, 256, (4, 96), generator=torch.Generator().manual_seed(7))
    return kv_spectra(model, tokens, skip=2)


def _basis_file(path, model, spectrum, ranks, value_ranks=None):
    (eigenvalues, vectors), (v_eigenvalues, v_vectors) = spectrum
    values = None if value_ranks is None else (v_vectors, value_ranks, v_eigenvalues)
    save_basis(path, vectors, ranks, eigenvalues, {"model": "tiny-llama", "model_config_hash": config_hash(model.config),
                                                   "target": "test", "align": 1, "settings": {}}, values)
    return str(path)


@pytest.fixture(scope="module")
def full_basis(tmp_path_factory, model, spectrum):
    full = torch.full((2, 2), 16, dtype=torch.int32)
    return _basis_file(tmp_path_factory.mktemp("lowrank") / "full.safetensors", model, spectrum, full, full)


def _stack(basis, rank=None, sinks=SINKS, recent=RECENT, flush=FLUSH, before=(), after=(), value_rank=None):
    entry = {"lowrank": {"basis": basis, "rank": rank, "value_rank": value_rank, "sinks": sinks, "recent": recent,
                         "flush": flush}}
    return {"compressors": [*before, entry, *after]}


def _ids(length, seed):
    return torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _streamed(model, stack, ids, chunks):
    with kvcompress.compress(model, stack) as cache:
        return streamed_logits(model, ids, cache, chunks), cache


def _first_columns(basis_file, rank, values=False):
    """The oracle's basis: the file's (re-orthonormalized) directions, first ``rank`` of each head."""
    f = load_basis(basis_file)
    return (f.value_basis if values else f.basis)[..., :rank]


# ----------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("value_rank", [None, 16])
def test_full_rank_equals_uncompressed_model(model, full_basis, value_rank):
    length = 160
    ids = _ids(length, 0)
    chunks = decode_chunks(50, length, [(100, 4)])
    got, cache = _streamed(model, _stack(full_basis, value_rank=value_rank), ids, chunks)
    assert all(layer.middle.num_tokens > 0 for layer in cache.compressed_layers)  # keys really went through U
    dense = masked_logits(model, ids, causal_visibility(length))
    assert (got - dense).abs().max().item() < 1e-4


@pytest.mark.parametrize("rank", [8, 4])
def test_decode_logits_match_projected_key_oracle(model, full_basis, rank):
    length = 180
    ids = _ids(length, rank)
    chunks = decode_chunks(60, length, [(120, 5)])
    got, _ = _streamed(model, _stack(full_basis, rank=rank), ids, chunks)
    ref = middle_oracle_logits(model, ids, chunks, sinks=SINKS, recent=RECENT, flush=FLUSH,
                               basis=_first_columns(full_basis, rank))
    assert (got - ref).abs().max().item() < 1e-4
    assert (got - masked_logits(model, ids, causal_visibility(length))).abs().max().item() > 1e-3


def test_value_basis_matches_projected_key_and_value_oracle(model, full_basis):
    length = 170
    ids = _ids(length, 21)
    chunks = decode_chunks(60, length, [(110, 3)])
    got, cache = _streamed(model, _stack(full_basis, rank=8, value_rank=4), ids, chunks)
    for layer in cache.compressed_layers:
        (_, buf), = layer.middle.lanes
        assert (buf.k.shape[-1], buf.v.shape[-1]) == (8, 4)  # coordinates of both
    ref = middle_oracle_logits(model, ids, chunks, sinks=SINKS, recent=RECENT, flush=FLUSH,
                               basis=_first_columns(full_basis, 8), value_basis=_first_columns(full_basis, 4, True))
    assert (got - ref).abs().max().item() < 1e-4
    keys_only = middle_oracle_logits(model, ids, chunks, sinks=SINKS, recent=RECENT, flush=FLUSH,
                                     basis=_first_columns(full_basis, 8))
    assert (got - keys_only).abs().max().item() > 1e-3  # the value projection really changed the output


def test_per_head_ranks_form_lanes_and_match_oracle(tmp_path, model, spectrum):
    ranks = torch.tensor([[8, 4], [12, 8]], dtype=torch.int32)
    path = _basis_file(tmp_path / "mixed.safetensors", model, spectrum, ranks)
    length = 150
    ids = _ids(length, 3)
    chunks = decode_chunks(70, length)
    got, cache = _streamed(model, _stack(path), ids, chunks)
    lanes = [[(g.heads.tolist(), buf.k.shape[-1]) for g, buf in layer.middle.lanes] for layer in cache.compressed_layers]
    assert lanes == [[([0], 8), ([1], 4)], [([0], 12), ([1], 8)]]
    basis = load_basis(path).basis  # [2, 2, 16, 12], columns beyond a head's rank are zero
    assert basis.shape == (2, 2, 16, 12) and basis[0, 1, :, 4:].abs().max() == 0
    ref = middle_oracle_logits(model, ids, chunks, sinks=SINKS, recent=RECENT, flush=FLUSH, basis=basis)
    assert (got - ref).abs().max().item() < 1e-4


def test_error_grows_monotonically_as_rank_falls(model, full_basis):
    length = 160
    ids = _ids(length, 5)
    chunks = decode_chunks(40, length)
    dense = masked_logits(model, ids, causal_visibility(length))
    p = torch.log_softmax(dense, -1)
    kls, recon = [], []
    for rank in (16, 12, 8, 4, 2):
        got, _ = _streamed(model, _stack(full_basis, rank=rank), ids, chunks)
        q = torch.log_softmax(got, -1)
        kls.append(float((p.exp() * (p - q)).sum(-1).mean()))
        u = _first_columns(full_basis, rank)
        recon.append(float((torch.eye(16) - u @ u.transpose(-1, -2)).norm()))
    assert kls[0] < 1e-6
    assert all(a < b for a, b in zip(kls, kls[1:])), kls
    assert all(a < b for a, b in zip(recon, recon[1:])), recon


@pytest.mark.parametrize("value_rank", [None, 16])
def test_stacked_with_kivi_matches_quantized_coordinate_oracle(model, full_basis, value_rank):
    length, group = 200, 16
    ids = _ids(length, 11)
    chunks = decode_chunks(70, length)
    stack = _stack(full_basis, rank=8, value_rank=value_rank,
                   after=[{"kivi": {"bits": 2, "group": group, "residual": group}}])
    got, cache = _streamed(model, stack, ids, chunks)
    for layer in cache.compressed_layers:  # KIVI stores codes and scales of the 8 coordinates, per channel
        (_, bufs), = layer.middle.lanes
        assert bufs["k_scale"].shape[-1] == 8 and bufs["v_scale"].shape[1] == 2
    # layout: recent = max(24, 16), flush = lcm(8, 16)
    value_basis = None if value_rank is None else _first_columns(full_basis, value_rank, True)  # values rotated
    ref = middle_oracle_logits(model, ids, chunks, sinks=SINKS, recent=RECENT, flush=group, bits=2, group=group,
                               basis=_first_columns(full_basis, 8), value_basis=value_basis)
    assert (got - ref).abs().max().item() < 1e-4


def test_window_eviction_upstream_matches_oracle(model, full_basis):
    length, budget = 220, 40
    ids = _ids(length, 13)
    chunks = decode_chunks(80, length)
    stack = _stack(full_basis, rank=8, before=[{"window": {"sinks": SINKS, "recent": RECENT + budget}}])
    got, _ = _streamed(model, stack, ids, chunks)
    ref = middle_oracle_logits(model, ids, chunks, sinks=SINKS, recent=RECENT, flush=FLUSH, budget=budget,
                               basis=_first_columns(full_basis, 8))
    assert (got - ref).abs().max().item() < 1e-4


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("rank", [16, 8, 4])
def test_memory_report_holds_rank_over_head_dim_of_middle_keys(model, full_basis, rank):
    ids = _ids(100, 1)
    with kvcompress.compress(model, _stack(full_basis, rank=rank)) as cache:
        with torch.no_grad():
            model(ids, cache=cache)
    middle = 100 - SINKS - RECENT - (100 - SINKS - RECENT) % FLUSH  # flushed tokens
    for layer in cache.compressed_layers:
        (_, buf), = layer.middle.lanes
        assert buf.size == middle
        assert buf.k.nbytes / (middle * 2 * 16 * 4) == rank / 16  # K: rank of head_dim 16 channels, fp32
        assert buf.v.nbytes == middle * 2 * 16 * 4  # V unchanged
    # per layer: K 2 heads x rank + V 2 heads x 16 (fp32); the lane of every head keeps the row's validity byte
    # and int64 position per token (the row bookkeeping, "middle (rows)")
    segments = cache.memory_report().segments
    assert segments["middle"] == 2 * middle * 4 * (2 * rank + 2 * 16)
    assert segments["middle (rows)"] == 2 * middle * (1 + 8)


# ----------------------------------------------------------------------------- config and files


def test_config_errors_name_the_key(tmp_path, model, spectrum, full_basis):
    no_values = _basis_file(tmp_path / "keys.safetensors", model, spectrum, torch.full((2, 2), 8, dtype=torch.int32))
    cases = [
        ({"lowrank": {"basis": str(tmp_path / "missing.safetensors")}}, "compressors[0].lowrank.basis", "calibrate lowrank"),
        ({"lowrank": {}}, "compressors[0].lowrank.basis", "existing basis file"),
        ({"lowrank": {"basis": full_basis, "rank": 17}}, "compressors[0].lowrank.rank", "[1, 16]"),
        ({"lowrank": {"basis": full_basis, "rank": 0}}, "compressors[0].lowrank.rank", "[1, 1024] (or null), got 0"),
        ({"lowrank": {"basis": full_basis, "ranks": 8}}, "compressors[0].lowrank.ranks", "known parameters"),
        ({"lowrank": {"basis": full_basis, "flush": 0}}, "compressors[0].lowrank.flush", "got 0"),
        ({"lowrank": {"basis": full_basis, "value_rank": 17}}, "compressors[0].lowrank.value_rank", "[1, 16]"),
        ({"lowrank": {"basis": no_values, "value_rank": 8}}, "compressors[0].lowrank.value_rank", "no value basis"),
    ]
    for entry, path, text in cases:
        with pytest.raises(ConfigError) as err:
            parse_stack({"compressors": [entry]})
        assert err.value.path == path and text in str(err.value), str(err.value)


def test_leank_and_lowrank_on_the_same_keys_are_rejected(full_basis):
    with pytest.raises(ConfigError) as err:
        parse_stack({"compressors": [{"leank": {}}, {"lowrank": {"basis": full_basis}}]})
    assert err.value.path == "compressors[1].lowrank" and "key channels" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_stack({"compressors": [{"lowrank": {"basis": full_basis}}, {"kivi": {"key_axis": "token"}}]})
    assert err.value.path == "compressors[1].kivi.key_axis" and "'channel'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_stack({"compressors": [{"lowrank": {"basis": full_basis, "value_rank": 8}}, {"kivi": {"group": 16}}]})
    assert err.value.path == "compressors[0].lowrank.value_rank" and "multiple of kivi's group (16" in str(err.value)


def test_basis_for_another_model_or_format_is_refused(tmp_path, full_basis):
    other = tiny_model("qwen3")
    with pytest.raises(BasisFileError) as err:
        with kvcompress.compress(other, _stack(full_basis)):
            pass
    assert "tiny-llama" in str(err.value) and "calibrate lowrank" in str(err.value)
    mask = tmp_path / "mask.safetensors"
    save_mask(mask, rope_mask(other.config, 0.5, 4), {"model": "q", "model_config_hash": config_hash(other.config),
                                                      "ratio": 0.5, "align": 4, "sinks": 1, "local": 1,
                                                      "method": "rope", "settings": {}})
    with pytest.raises(BasisFileError, match="kvcompress.lowrank-basis/1"):
        load_basis(mask)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(BasisFileError, match="unreadable"):
        load_basis(junk)


def test_rank_choice_by_energy_and_alignment():
    eig = torch.tensor([[[8.0, 4.0, 2.0, 1.0, 0.5, 0.5, 0.0, 0.0]]])  # total 16
    assert choose_ranks(eig, energy=0.75, align=1).item() == 2  # 12/16
    assert choose_ranks(eig, energy=0.76, align=1).item() == 3
    assert choose_ranks(eig, energy=0.76, align=2).item() == 4
    assert choose_ranks(eig, energy=1.0, align=4).item() == 8
    assert choose_ranks(eig, rank=4).item() == 4
    assert energy_kept(eig, torch.tensor([[3]])).item() == pytest.approx(14 / 16)
    for kwargs, option in [({"rank": 8, "energy": 0.9}, "--rank/--energy"), ({}, "--rank/--energy"),
                           ({"rank": 12, "align": 8}, "--rank"), ({"energy": 1.5}, "--energy"),
                           ({"rank": 8, "align": 3}, "--align"), ({"rank": 8, "skip": 2000}, "--skip")]:
        with pytest.raises(ConfigError) as err:
            LowRankSettings(**kwargs).validate(head_dim=64 if "align" in kwargs else None)
        assert err.value.path == option


def test_calibrate_cli_rejects_bad_options_before_loading_a_model(tmp_path):
    run = [sys.executable, "-m", "kvcompress.calibration.cli", "calibrate", "lowrank"]
    out = subprocess.run(run + ["--rank", "12", "--align", "8", "--out", str(tmp_path / "b.safetensors")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--rank: expected a multiple of --align (8)" in out.stderr
    out = subprocess.run(run + ["--rank", "8", "--energy", "0.9", "--out", "x.safetensors"], capture_output=True, text=True)
    assert out.returncode == 2 and "not allowed with argument" in out.stderr
    assert not (tmp_path / "b.safetensors").exists()


def test_shipped_basis_and_calibration_on_the_default_model(tmp_path, default_model):
    model, tokenizer = default_model
    shipped = load_basis("masks/smollm2-135m-lowrank-48.safetensors", model.config)
    u = shipped.basis
    assert u.shape == (30, 3, 64, 48) and shipped.meta["target"] == "rank=48"
    assert torch.allclose(u.transpose(-1, -2) @ u, torch.eye(48).expand(30, 3, 48, 48), atol=1e-5)
    from kvcompress.calibration.lowrank import calibrate

    f = calibrate(LowRankSettings(energy=0.9, align=8, context=64, samples=2, skip=4), model=model,
                  tokenizer=tokenizer, model_name="default", out=str(tmp_path / "e.safetensors"), log=None)
    assert bool((f.rank % 8 == 0).all()) and bool((energy_kept(f.eigenvalues, f.rank) >= 0.9).all())
    smaller = f.rank - 8  # every head's rank is the smallest aligned one reaching the energy
    assert bool((energy_kept(f.eigenvalues, smaller) < 0.9).all())
    with pytest.raises(KVCompressError, match="basis made for"):
        load_basis(tmp_path / "e.safetensors", tiny_model("llama").config)
