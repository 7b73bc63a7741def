"""LeanK: learned static K-channel pruning of the cache middle, regrouped by kept count.

Zhang et al. *LeanK: Learnable K Cache Channel Pruning for Efficient Decoding.*
EMNLP 2025, arXiv:2508.02215.

A static mask ``keep[layer, kv_head, channel]`` over post-RoPE key channels
(learned by ``kvcompress calibrate leank``, or the training-free RoPE-frequency
heuristic ``mask: rope`` that keeps each head's lowest-frequency channel pairs)
decides which key channels the *middle* of the cache keeps.  The attention
sinks and the local window stay full precision and unpruned.

Every ``flush`` tokens that leave the local window are pruned (each head keeps
only its channels: ``kvcompress_prune_channels``), then heads with the same kept
count are regrouped into one dense tensor ``[batch, heads, tokens, count]``
(``kvcompress_regroup_heads``); heads that keep no channel store neither middle
K nor middle V and attend to sinks + local window only.  Attention gathers the
query to each group's kept channels, keeps the softmax scale of the full head
dimension and merges sinks, groups and window by log-sum-exp.

Stacked before KIVI, the quantizer receives the regrouped pruned keys and
quantizes them per channel (prune -> regroup -> quantize): only kept channels
pay for codes and scales.

Parameters: ``mask`` ("rope" or a mask file), ``ratio`` / ``align`` (for the
RoPE heuristic; a file carries its own), ``sinks`` (128), ``local`` (768) and
``flush`` (128), the authors' deployment defaults.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from kvcompress import Compressor, CompressorSpec, Layout, hookimpl, param
from kvcompress.errors import ConfigError
from kvcompress.state import HeadGroup


@dataclasses.dataclass(frozen=True)
class LeanKConfig:
    mask: str = param("rope", "'rope' (keep each head's lowest-frequency RoPE channel pairs, no training) or the "
                      "path of a mask file made by `kvcompress calibrate leank`")
    ratio: float = param(0.5, "fraction of key channels pruned by the 'rope' mask (a mask file carries its own)",
                         type=float, min=0.0, max=1.0)
    align: int = param(16, "kept channels per head are a multiple of this ('rope' mask)", min=1, max=1024)
    sinks: int = param(128, "first real tokens kept with all channels (attention sinks)", min=0, max=1 << 20)
    local: int = param(768, "most recent tokens kept with all channels (local window)", min=0, max=1 << 20)
    flush: int = param(128, "tokens leave the local window in blocks of this many", min=1, max=1 << 16)

    def check(self, path: str) -> None:
        if self.mask == "rope":
            return
        if not os.path.isfile(self.mask):
            raise ConfigError(f"{path}.mask", "'rope' or an existing mask file (.safetensors)", self.mask,
                              hint="make one with `kvcompress calibrate leank --ratio 0.5 --align 16 --out FILE`")
        from kvcompress.calibration.files import validate_file
        from kvcompress.calibration.masks import load_mask

        validate_file(f"{path}.mask", load_mask, self.mask)  # everything but the model match, before any model


class LeanKCompressor(Compressor):
    name = "leank"
    graph_safe = True

    def __init__(self, config: LeanKConfig):
        super().__init__(config)
        self.keep: torch.Tensor | None = None  # bool [layers, kv_heads, head_dim]

    def load(self, model_config, info=None) -> torch.Tensor:
        """The mask for ``model_config`` (a mask file for another model is refused), narrowed to the KV heads of
        ``info`` under tensor parallelism."""
        if self.keep is None:
            from kvcompress.calibration.masks import load_mask, rope_mask
            from kvcompress.distributed import local_heads, naming_split

            if self.config.mask == "rope":
                keep = rope_mask(model_config, self.config.ratio, self.config.align)
            else:
                with naming_split(info):
                    keep = load_mask(self.config.mask, model_config).keep.bool()
            self.keep = local_heads(keep, info)  # [layers, this rank's kv heads, head_dim]
        return self.keep

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        self.load(layer.model_config, layer)  # fail at cache build, not at the first flush
        return Layout(sinks=self.config.sinks or None, recent=self.config.local, flush=self.config.flush)

    def _plan(self, layer, device) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per kv head: (index, ``[1]`` head tensor, kept channels) on ``device``, built once per layer."""
        plan = layer.state.get("leank")
        if plan is None:
            keep = self.keep[layer.info.index]
            plan = [(h, torch.tensor([h], device=device), keep[h].nonzero().flatten().to(device))
                    for h in range(keep.shape[0])]
            layer.state["leank"] = plan
        return plan

    @hookimpl
    def kvcompress_prune_channels(self, layer, block):
        groups = []
        for h, heads, channels in self._plan(layer, block.k.device):
            groups.append(HeadGroup(heads, block.k[:, h:h + 1].index_select(-1, channels), block.v[:, h:h + 1],
                                    channels.unsqueeze(0)))
        return dataclasses.replace(block, k=None, v=None, groups=groups)

    @hookimpl
    def kvcompress_regroup_heads(self, layer, block):
        if block.groups is None:
            return None
        by_count: dict[int, list[HeadGroup]] = {}
        for g in block.groups:
            by_count.setdefault(g.k.shape[-1], []).append(g)
        merged = []
        for count in sorted(by_count, reverse=True):
            if count == 0:  # keeps nothing: no middle K and no middle V
                continue
            gs = by_count[count]
            # groups arrive in head order (_plan): a group of every head reads as all heads
            merged.append(HeadGroup(torch.cat([g.heads for g in gs]), torch.cat([g.k for g in gs], dim=1),
                                    torch.cat([g.v for g in gs], dim=1), torch.cat([g.channels for g in gs]),
                                    every_head=len(gs) == layer.info.num_kv_heads))
        return dataclasses.replace(block, k=None, v=None, groups=merged)


@hookimpl
def kvcompress_register_compressors(register):
    register(CompressorSpec(
        name="leank", axis="prune", config=LeanKConfig, factory=LeanKCompressor,
        summary="LeanK static K-channel pruning of the middle, regrouped by kept count (arXiv:2508.02215)",
    ))
