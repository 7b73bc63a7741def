"""Low-rank keys: the cache middle stores each key as its coordinates in a calibrated PCA basis.

Keys of an attention head live close to a low-dimensional subspace: Loki (Singhania et al.,
*Loki: Low-rank Keys for Efficient Sparse Attention*, arXiv:2406.02542) observes it for post-RoPE
keys and scores in a PCA basis; Palu (Chang et al., *Palu: Compressing KV-Cache with Low-Rank
Projection*, arXiv:2407.21118) and Eigen Attention (Saxena et al., *Eigen Attention: Attention in
Low-Rank Space for KV Cache Compression*, arXiv:2408.05646) store the cache in such a basis.

``kvcompress calibrate lowrank --rank r | --energy e`` computes, per layer and KV head, the PCA
basis ``U`` (``[head_dim, r]``, orthonormal columns) of post-RoPE keys over offline text.  On the
transform stage (after eviction, before quantization), every block of ``flush`` tokens leaving
the recent window stores its keys as ``c = k U`` (``r`` numbers instead of ``head_dim``); values
are unchanged.  The attention sinks and the recent window stay full precision.  Attention maps
the query into the same basis, ``q U``, scores ``(q U) . c = q . (k U U^T)`` - the exact score
against the key's projection - with the softmax scale of the full head dimension, and merges
sinks, middle lanes and window by log-sum-exp.  Heads with equal rank share one dense lane
``[batch, heads, tokens, r]`` (a file made with ``--energy`` gives heads different ranks).

Optional value basis (``value_rank``, a file made with ``--value-rank``): middle values are stored
as ``c_v = v U_v`` too; attention over them yields coordinates, mapped back by ``U_v^T`` (exact,
since attention is linear in the values: ``P (C_v U_v^T) = (P C_v) U_v^T``).

Memory: the middle K costs ``r / head_dim`` of its dense size (the memory report shows it).  At
``r = head_dim`` the projection is a rotation and attention equals the uncompressed model's.

Stacking: token eviction upstream is free (it runs before the transform); KIVI downstream
receives the coordinates and quantizes them per channel (a channel is a basis direction, and its
groups of G tokens get their own scale), so low-rank + KIVI-2 stores ``r / head_dim`` of the key
codes.  LeanK prunes the same key channels and is rejected in the same stack (the
"key channels" axis is exclusive: the projection already chooses the channels worth keeping).

Parameters: ``basis`` (file), ``rank`` (use the first ``rank`` directions of every head; null =
the file's ranks), ``value_rank`` (null: values unchanged), ``sinks`` (128), ``recent`` (768), ``flush`` (128): LeanK's deployment regions,
so the two compare at equal key bytes.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from kvcompress import Compressor, CompressorSpec, Layout, LinearQueryMap, hookimpl, param
from kvcompress.errors import ConfigError
from kvcompress.kernels.attention.reference import to_float32
from kvcompress.state import HeadGroup

_HINT = "make one with `kvcompress calibrate lowrank --rank 32 --out FILE.safetensors`"


@dataclasses.dataclass(frozen=True)
class LowRankConfig:
    basis: str = param("", "path of a basis file made by `kvcompress calibrate lowrank`")
    rank: int | None = param(None, "keep the first `rank` basis directions of every head (at most the file's "
                             "smallest rank); null: the file's per-head ranks", type=int, min=1, max=1024,
                             nullable=True)
    value_rank: int | None = param(None, "store middle values as their first `value_rank` coordinates in the "
                                   "file's value basis (made with --value-rank); null: values unchanged", type=int,
                                   min=1, max=1024, nullable=True)
    sinks: int = param(128, "first real tokens kept full precision (attention sinks)", min=0, max=1 << 20)
    recent: int = param(768, "most recent tokens kept full precision", min=0, max=1 << 20)
    flush: int = param(128, "tokens leave the recent window in blocks of this many", min=1, max=1 << 16)

    def check(self, path: str) -> None:
        if not self.basis or not os.path.isfile(self.basis):
            raise ConfigError(f"{path}.basis", "an existing basis file (.safetensors)", self.basis, hint=_HINT)
        from kvcompress.calibration.files import validate_file
        from kvcompress.calibration.lowrank import load_basis

        f = validate_file(f"{path}.basis", load_basis, self.basis)  # everything but the model match, before any model
        for key, ranks in (("rank", f.rank), ("value_rank", f.value_rank)):
            value = getattr(self, key)
            if value is None:
                continue
            if ranks is None:
                raise ConfigError(f"{path}.{key}", f"null ({self.basis} holds no value basis)", value,
                                  hint=_HINT.replace("--out", f"--value-rank {value} --out"))
            if value > int(ranks.min()):
                raise ConfigError(f"{path}.{key}", f"an integer in [1, {int(ranks.min())}] (the smallest {key} "
                                  f"in {self.basis}) or null", value)


class LowRankCompressor(Compressor):
    name = "lowrank"
    graph_safe = True

    def __init__(self, config: LowRankConfig):
        super().__init__(config)
        self.groups: list[list[tuple]] | None = None  # per layer: (heads, U [h, d, r], U_v [h, d, r_v] or None)

    def load(self, model_config, info=None) -> list[list[tuple]]:
        """Per layer, heads grouped by (key rank, value rank) with their bases (refused for another model); under
        tensor parallelism the heads of ``info``'s rank only, numbered locally."""
        if self.groups is None:
            from kvcompress.calibration.lowrank import load_basis
            from kvcompress.distributed import local_heads, naming_split

            with naming_split(info):
                f = load_basis(self.config.basis, model_config)
            f = dataclasses.replace(f, **{name: local_heads(getattr(f, name), info) for name in
                                          ("basis", "rank", "value_basis", "value_rank")
                                          if getattr(f, name) is not None})
            ranks = f.rank if self.config.rank is None else torch.full_like(f.rank, self.config.rank)
            v_ranks = torch.zeros_like(ranks) if self.config.value_rank is None else torch.full_like(
                ranks, self.config.value_rank)
            self.groups = []
            for layer, (rank, v_rank) in enumerate(zip(ranks, v_ranks)):
                pairs = sorted(set(zip(rank.tolist(), v_rank.tolist())), reverse=True)
                groups = []
                for r, rv in pairs:
                    heads = ((rank == r) & (v_rank == rv)).nonzero().flatten()
                    u_v = f.value_basis[layer, heads, :, :rv].contiguous() if rv else None
                    groups.append((heads, f.basis[layer, heads, :, :r].contiguous(), u_v))
                self.groups.append(groups)
        return self.groups

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        self.load(layer.model_config, layer)  # fail at cache build, not at the first flush
        return Layout(sinks=self.config.sinks or None, recent=self.config.recent, flush=self.config.flush)

    def _plan(self, layer, device, dtype) -> list[tuple]:
        """Per group: (heads, U, U_v, query map q -> q U, output map o -> o U_v^T) on ``device``, built once (the
        query map a :class:`kvcompress.LinearQueryMap` for coordinates stored in ``dtype``: the read kernels
        project the query themselves)."""
        plan = layer.state.get("lowrank")
        if plan is None:
            plan = []
            for heads, basis, v_basis in self.groups[layer.info.index]:
                heads, basis = heads.to(device), basis.to(device)
                project = LinearQueryMap.of(basis, dtype)
                unproject = None
                if v_basis is not None:
                    v_basis = v_basis.to(device)

                    def unproject(o: torch.Tensor, v_basis: torch.Tensor = v_basis) -> torch.Tensor:
                        return _like(torch.einsum("bhnr,hdr->bhnd", to_float32(o), v_basis), o)

                plan.append((heads, basis, v_basis, project, unproject))
            layer.state["lowrank"] = plan
        return plan

    @hookimpl
    def kvcompress_lowrank_transform(self, layer, block):
        groups = []
        for heads, basis, v_basis, project, unproject in self._plan(layer, block.k.device, block.k.dtype):
            k = torch.einsum("bhtd,hdr->bhtr", block.k.index_select(1, heads).float(), basis).to(block.k.dtype)
            v = block.v.index_select(1, heads)
            if v_basis is not None:
                v = torch.einsum("bhtd,hdr->bhtr", v.float(), v_basis).to(block.v.dtype)
            # heads come sorted (load): a group of every head reads as all heads
            groups.append(HeadGroup(heads, k, v, qmap=project, vmap=unproject,
                                    every_head=heads.shape[0] == layer.info.num_kv_heads))
        return dataclasses.replace(block, k=None, v=None, groups=groups)

    @hookimpl
    def kvcompress_validate_stack(self, entries):
        mine = next((i for i, (_, config) in enumerate(entries) if config is self.config), 0)
        for i, (name, config) in enumerate(entries):
            if name != "kivi":
                continue
            if config.key_axis != "channel":
                raise ConfigError(f"compressors[{i}].kivi.key_axis", "'channel' after lowrank (the stored "
                                  "coordinates are quantized per basis direction)", config.key_axis)
            if self.config.value_rank is not None and self.config.value_rank % config.group:
                raise ConfigError(f"compressors[{mine}].lowrank.value_rank", f"a multiple of kivi's group "
                                  f"({config.group}: KIVI quantizes values in groups of channels) or null",
                                  self.config.value_rank)


def _like(t: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``t`` in ``other``'s dtype (no op dispatched when it already is: the maps run every decode step)."""
    return t if t.dtype == other.dtype else t.to(other.dtype)


@hookimpl
def kvcompress_register_compressors(register):
    register(CompressorSpec(
        name="lowrank", axis="lowrank", config=LowRankConfig, factory=LowRankCompressor,
        summary="low-rank keys: middle K stored as PCA coordinates, query projected (arXiv:2406.02542)",
    ))
