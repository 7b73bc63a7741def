"""Low-rank key bases: PCA of post-RoPE keys per (layer, KV head), rank choice, and the basis file.

Keys of a head live close to a low-dimensional subspace (Loki, arXiv 2406.02542; Palu, arXiv
2407.21118; Eigen Attention, arXiv 2408.05646).  Calibration runs the model over offline text
(:mod:`.data`, training split), collects every layer's post-RoPE keys through the calibration
attention (:mod:`.attention`, exact SDPA with an observer) and accumulates, per (layer, KV head),
the *uncentred* second moment ``M = sum_t k_t k_t^T`` (the keys' mean direction is kept in the basis,
so ``q . k ~ (q U) . (k U)`` needs no offset term).  Its eigenvectors, by decreasing eigenvalue, are
the basis; the energy fraction of the top ``r`` is ``sum_{i<r} lambda_i / sum_i lambda_i``.

File format ``kvcompress.lowrank-basis/1`` (safetensors, never pickle):

* ``basis``: float16 ``[layers, kv_heads, head_dim, R]``, orthonormal columns by decreasing
  eigenvalue (R = the largest per-head rank; columns beyond a head's rank are zero);
* ``rank``: int32 ``[layers, kv_heads]``, the rank each head keeps (a multiple of ``align``);
* ``eigenvalues``: float32 ``[layers, kv_heads, head_dim]``, the full spectrum (mean per key);
* optional ``value_basis`` / ``value_rank`` / ``value_eigenvalues``: the same for values (made with
  ``--value-rank``; the compressor then stores middle values as coordinates too);
* string metadata: ``format``, ``model``, ``model_config_hash``, ``model_geometry`` (JSON),
  ``target`` (``rank=r`` or ``energy=e``), ``align``, ``settings`` (JSON), ``created``.

Light at import (torch + safetensors); the collection pass imports transformers on first use.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import time
from typing import Any, Iterable, TextIO

import torch

from ..errors import ConfigError
from .files import FLOAT, INT, CalibrationFileError, Tensor, read
from .masks import _text_config, config_hash, describe_model, geometry

FORMAT = "kvcompress.lowrank-basis/1"


class BasisFileError(CalibrationFileError):
    """A basis file is missing, malformed, or was made for another model (``path`` is the file)."""

    kind = "basis file"
    default_hint = "make one with: kvcompress calibrate lowrank --rank R --out FILE.safetensors"


@dataclasses.dataclass(frozen=True)
class LowRankSettings:
    """Calibration settings (recorded in the file's ``settings`` metadata)."""

    rank: int | None = None
    energy: float | None = None
    align: int = 8
    context: int = 1024
    samples: int = 8
    skip: int = 16
    seed: int = 0
    value_rank: int | None = None

    def validate(self, head_dim: int | None = None) -> "LowRankSettings":
        """Raise ConfigError naming the option; ``rank``/``align`` against ``head_dim`` when given."""
        if (self.rank is None) == (self.energy is None):
            raise ConfigError("--rank/--energy", "exactly one of --rank R or --energy E",
                              f"rank={self.rank}, energy={self.energy}")
        top = head_dim or 1 << 16
        if self.energy is not None and (not isinstance(self.energy, (int, float)) or math.isnan(self.energy)
                                        or not 0.0 < self.energy <= 1.0):
            raise ConfigError("--energy", "a fraction of key energy in (0, 1]", self.energy)
        if isinstance(self.align, bool) or not isinstance(self.align, int) or not 1 <= self.align <= top \
                or (head_dim and head_dim % self.align):
            raise ConfigError("--align", f"a positive divisor of head_dim{f' {head_dim}' if head_dim else ''}",
                              self.align)
        for name in ("rank", "value_rank"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top
                                      or value % self.align):
                raise ConfigError(f"--{name.replace('_', '-')}", f"a multiple of --align ({self.align}) in "
                                  f"[1, {top}]", value)
        for name, lo in (("context", 2), ("samples", 1), ("skip", 0), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"--{name}", f"an integer >= {lo}", value)
        if self.skip >= self.context:
            raise ConfigError("--skip", f"fewer than --context ({self.context}) tokens", self.skip)
        return self


# ----------------------------------------------------------------------------- PCA


class Moments:
    """``sum_t x_t x_t^T`` (float64) per (layer, KV head) of keys or values, leading tokens skipped."""

    def __init__(self, shape: tuple[int, int, int], skip: int = 0):
        layers, kv_heads, d = shape
        self.sums = torch.zeros(layers, kv_heads, d, d, dtype=torch.float64)
        self.counts = torch.zeros(layers, dtype=torch.long)
        self.skip = skip

    def add(self, layer: int, x: torch.Tensor) -> None:
        x = x.detach()[:, :, self.skip:].double()  # [B, Hkv, T, d]
        self.sums[layer] += torch.einsum("bhtc,bhte->hce", x, x)
        self.counts[layer] += x.shape[0] * x.shape[2]

    def spectrum(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(eigenvalues ``[L, H, d]`` descending, mean per token; eigenvectors ``[L, H, d, d]`` as columns)."""
        mean = self.sums / self.counts.clamp(min=1).view(-1, 1, 1, 1)
        values, vectors = torch.linalg.eigh(mean)  # ascending
        return values.flip(-1).clamp(min=0).float(), vectors.flip(-1).float()


@torch.no_grad()
def kv_spectra(model: Any, tokens: Iterable[torch.Tensor] | torch.Tensor, skip: int = 0):
    """Uncentred PCA of ``model``'s post-RoPE keys and of its values over ``tokens`` (``[n, length]`` or
    windows), the first ``skip`` tokens of every window (attention sinks, kept full precision) left out.

    Returns ``(key spectrum, value spectrum)``, each :meth:`Moments.spectrum`.
    """
    from ..adapters import hf
    from .attention import ScaledKeys, check_calibratable, scaled_keys

    check_calibratable(model)
    keys, values = Moments(geometry(model.config), skip), Moments(geometry(model.config), skip)
    if isinstance(tokens, torch.Tensor) and tokens.dim() == 2:
        tokens = list(tokens.split(1))
    for ids in tokens:
        state = ScaledKeys(capture={})
        with scaled_keys(model, state):
            hf.final_hidden_states(model, torch.as_tensor(ids).reshape(1, -1))
        for layer, (k, v) in state.capture.items():
            keys.add(layer, k)
            values.add(layer, v)
    return keys.spectrum(), values.spectrum()


def choose_ranks(eigenvalues: torch.Tensor, rank: int | None = None, energy: float | None = None,
                 align: int = 1) -> torch.Tensor:
    """Per-head ranks ``[L, H]``: ``rank`` everywhere, or the smallest rank keeping ``energy`` of the
    spectrum, rounded up to a multiple of ``align`` (at most head_dim)."""
    d = eigenvalues.shape[-1]
    if rank is not None:
        return torch.full(eigenvalues.shape[:-1], rank, dtype=torch.int32)
    total = eigenvalues.sum(-1, keepdim=True).clamp(min=1e-30)
    kept = eigenvalues.cumsum(-1) / total  # energy of the top 1..d
    need = (kept < energy - 1e-9).sum(-1) + 1  # smallest r with kept[r-1] >= energy
    return (torch.div(need + align - 1, align, rounding_mode="floor") * align).clamp(max=d).to(torch.int32)


def energy_kept(eigenvalues: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """Fraction of each head's key energy its rank keeps, ``[L, H]``."""
    idx = torch.arange(eigenvalues.shape[-1])
    kept = (eigenvalues * (idx < ranks.unsqueeze(-1))).sum(-1)
    return kept / eigenvalues.sum(-1).clamp(min=1e-30)


def truncate(vectors: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """The top ``ranks[l, h]`` columns of ``vectors`` ``[L, H, d, d]`` as ``[L, H, d, max rank]`` (rest zero)."""
    width = int(ranks.max())
    return vectors[..., :width] * (torch.arange(width) < ranks.unsqueeze(-1)).unsqueeze(-2)


def orthonormalize(basis: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """Re-orthonormalize each head's first ``rank`` columns (float64 QR, signs kept), so a basis stored
    in float16 spans nearly the same subspace with ``U^T U = I`` to float32 precision."""
    out = torch.zeros_like(basis, dtype=torch.float32)
    for l in range(basis.shape[0]):
        for h in range(basis.shape[1]):
            r = int(ranks[l, h])
            q, upper = torch.linalg.qr(basis[l, h, :, :r].double())
            out[l, h, :, :r] = (q * torch.where(torch.diagonal(upper) < 0, -1.0, 1.0)).float()
    return out


# ----------------------------------------------------------------------------- files


@dataclasses.dataclass
class BasisFile:
    """A loaded basis: ``basis`` float32 ``[L, H, d, R]``, ``rank`` ``[L, H]``, ``eigenvalues``, ``meta``."""

    basis: torch.Tensor
    rank: torch.Tensor
    eigenvalues: torch.Tensor
    meta: dict
    value_basis: torch.Tensor | None = None
    value_rank: torch.Tensor | None = None
    value_eigenvalues: torch.Tensor | None = None


def save_basis(path: str | os.PathLike, vectors: torch.Tensor, ranks: torch.Tensor, eigenvalues: torch.Tensor,
               meta: dict, values: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write a basis file: the top ``ranks[l, h]`` columns of ``vectors`` ``[L, H, d, d]`` in float16
    (``values``: optional ``(vectors, ranks, eigenvalues)`` of the value basis, stored the same way)."""
    from safetensors.torch import save_file

    basis = truncate(vectors, ranks)
    layers, kv_heads, d, _ = vectors.shape
    strings = {k: json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v) for k, v in meta.items()}
    strings.setdefault("model_geometry", json.dumps({"layers": layers, "kv_heads": kv_heads, "head_dim": d}))
    strings["format"] = FORMAT
    strings.setdefault("created", datetime.date.today().isoformat())
    tensors = {"basis": basis.to(torch.float16).contiguous(), "rank": ranks.to(torch.int32).clone(),
               "eigenvalues": eigenvalues.float().contiguous()}
    if values is not None:
        v_vectors, v_ranks, v_eigenvalues = values
        tensors.update({"value_basis": truncate(v_vectors, v_ranks).to(torch.float16).contiguous(),
                        "value_rank": v_ranks.to(torch.int32).clone(),
                        "value_eigenvalues": v_eigenvalues.float().contiguous()})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, f"{path}.tmp", metadata=strings)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(f"{path}.tmp", 0o666 & ~umask)  # safetensors writes through a private (0600) temporary file
    os.replace(f"{path}.tmp", path)


_TENSORS = {f"{pre}{name}": Tensor(dtypes, ndim, required=not pre) for pre in ("", "value_")
            for name, dtypes, ndim in (("basis", FLOAT, 4), ("rank", INT, 2), ("eigenvalues", FLOAT, 3))}
_META_TYPES = {"model_geometry": "a JSON object", "settings": "a JSON object", "align": "an integer",
               "mean_rank": "a finite number", "mean_energy_kept": "a finite number",
               "min_energy_kept": "a finite number", "value_energy_kept": "a finite number", "seconds": "a finite number"}


def load_basis(path: str | os.PathLike, model_config: Any = None) -> BasisFile:
    """Read a basis file (safetensors only, with the checks of :func:`kvcompress.calibration.files.read`);
    with ``model_config``, refuse one made for another model."""
    path = os.fspath(path)
    tensors, meta = read(path, BasisFileError, "low-rank basis file", FORMAT, _TENSORS, _META_TYPES)
    values = [n for n in tensors if n.startswith("value_")]
    if values and len(values) != 3:
        raise BasisFileError(path, "value_basis, value_rank and value_eigenvalues together (or none)",
                             ", ".join(sorted(tensors)))
    prefixes = ("", "value_") if values else ("",)
    for pre in prefixes:
        basis, rank = tensors[f"{pre}basis"], tensors[f"{pre}rank"]
        if basis.numel() == 0 or tuple(rank.shape) != tuple(basis.shape[:2]) or int(rank.min()) < 1 \
                or int(rank.max()) != basis.shape[-1] or basis.shape[-1] > basis.shape[2] \
                or basis.shape[:3] != tensors["basis"].shape[:3] \
                or tuple(tensors[f"{pre}eigenvalues"].shape) != tuple(basis.shape[:3]):
            raise BasisFileError(path, f"tensors {pre}basis [L, H, d, R <= d], {pre}rank [L, H] (1..R) and "
                                 f"{pre}eigenvalues [L, H, d]", {n: tuple(t.shape) for n, t in tensors.items()})
    parts = {}
    for pre in prefixes:
        rank = tensors[f"{pre}rank"].long()
        parts.update({f"{pre}basis": orthonormalize(tensors[f"{pre}basis"], rank), f"{pre}rank": rank,
                      f"{pre}eigenvalues": tensors[f"{pre}eigenvalues"].float()})
    out = BasisFile(meta=meta, **parts)
    if model_config is not None:
        check_basis_for_model(path, out, model_config)
    return out


def check_basis_for_model(path: str, basis: BasisFile, model_config: Any) -> None:
    """Refuse a basis whose geometry or model config hash differs from ``model_config``'s."""
    from .masks import config_fields

    layers, kv_heads, d, _ = basis.basis.shape
    same_shape = (layers, kv_heads, d) == geometry(model_config)
    if same_shape and basis.meta.get("model_config_hash") == config_hash(model_config):
        return
    c = _text_config(model_config)
    given = getattr(c, "_name_or_path", None) or None
    geo = basis.meta.get("model_geometry") or {}
    made_for = describe_model(basis.meta.get("model"), {"model_type": geo.get("model_type", "?"),
                                                        "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
                                                        "head_dim": d}, basis.meta.get("model_config_hash"))
    why = "its shape differs" if not same_shape else "the model config hash differs"
    model_opt = f" --model {given}" if given else ""
    raise BasisFileError(path, f"a basis made for the model given, "
                               f"{describe_model(given, config_fields(model_config), config_hash(model_config))}",
                         f"a basis made for {made_for}; {why}",
                         hint=f"make one with: kvcompress calibrate lowrank{model_opt} --rank R --out FILE.safetensors")


# ----------------------------------------------------------------------------- calibration


def calibrate(settings: LowRankSettings, *, model: Any = None, tokenizer: Any = None, model_name: str | None = None,
              out: str | None = None, log: TextIO | None = sys.stderr) -> BasisFile:
    """PCA of post-RoPE keys over ``settings.samples`` windows of training-split documentation text.

    Args:
        settings: rank or energy target, alignment and the calibration text sizes.
        model: a loaded transformers model (with ``tokenizer``), or a name / path for
            :func:`kvcompress.models.load_model` (None: the default model).
        model_name: recorded in the file (default: the model's ``name_or_path``).
        out: the ``.safetensors`` file to write (None: don't write).
        log: progress stream (None: silent).
    """
    from . import data

    settings.validate()
    if model is None or isinstance(model, (str, os.PathLike)):
        from ..models import load_model

        model, tokenizer = load_model(None if model is None else os.fspath(model))
    layers, kv_heads, head_dim = geometry(model.config)
    settings = settings.validate(head_dim)
    t0 = time.monotonic()
    windows = data.windows(data.split_tokens(tokenizer, "train"), settings.context, settings.samples,
                           seed=settings.seed)
    if log is not None:
        print(f"[lowrank] PCA of post-RoPE keys and values: {len(windows)} windows x {settings.context} tokens "
              f"(first {settings.skip} of each skipped)", file=log, flush=True)
    (eigenvalues, vectors), (v_eigenvalues, v_vectors) = kv_spectra(model, torch.tensor(windows), skip=settings.skip)
    ranks = choose_ranks(eigenvalues, settings.rank, settings.energy, settings.align)
    kept = energy_kept(eigenvalues, ranks)
    c = _text_config(model.config)
    target = f"rank={settings.rank}" if settings.rank is not None else f"energy={settings.energy}"
    meta = {"model": model_name or getattr(c, "_name_or_path", "") or "unknown",
            "model_config_hash": config_hash(model.config),
            "model_geometry": {"model_type": getattr(c, "model_type", "?"), "layers": layers, "kv_heads": kv_heads,
                               "head_dim": head_dim},
            "target": target, "align": settings.align,
            "settings": {**dataclasses.asdict(settings), "text": "pydoc_data.topics (training split)",
                         "pca": "uncentred second moment of post-RoPE keys per (layer, kv head)"},
            "mean_rank": round(float(ranks.float().mean()), 3),
            "mean_energy_kept": round(float(kept.mean()), 6), "min_energy_kept": round(float(kept.min()), 6),
            "seconds": round(time.monotonic() - t0, 1)}
    values = None
    if settings.value_rank is not None:
        v_ranks = choose_ranks(v_eigenvalues, settings.value_rank)
        values = (v_vectors, v_ranks, v_eigenvalues)
        meta["value_energy_kept"] = round(float(energy_kept(v_eigenvalues, v_ranks).mean()), 6)
    if out:
        save_basis(out, vectors, ranks, eigenvalues, meta, values)
        return load_basis(out, model.config)
    f = BasisFile(truncate(vectors, ranks), ranks.long(), eigenvalues, meta)
    if values is not None:
        f.value_basis, f.value_rank, f.value_eigenvalues = truncate(v_vectors, v_ranks), v_ranks.long(), v_eigenvalues
    return f
