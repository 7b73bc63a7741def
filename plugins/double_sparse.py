"""DoubleSparse: read-time top-k token selection from a label cache of a few key channels.

Yang, Hou, Li, Chen, Dong, Zhao, Gao. *Post-Training Sparse Attention with Double Sparsity.*
arXiv:2408.07092.

Each decode step scores every middle token from its **label** - its post-RoPE key restricted to
``r`` label channels per KV head (ranked offline by mean ``|q_c k_c|``:
``kvcompress calibrate doublesparse``) - as ``q[channels] . label``, keeps the ``k`` best tokens
**per query head** (GQA: each query head picks its own tokens and reads them from its KV head)
and attends exactly to those, to the attention sinks, to the recent window (a ring buffer) and
to the step's own token.  It cuts bytes read, not bytes stored: the label cache is extra.

The label cache lives in ``layer.state["double_sparse"]``, separate from the main cache: labels
are computed from full-precision keys when tokens leave the recent window (the score stage,
before any quantizer or pruner touches them), optionally quantized to 4 or 2 bits per token
(asymmetric min-max, fp16 scale and zero per token and head), so they stay valid when LeanK or
KIVI compress the main cache.  An evictor in the same stack is refused when the stack is loaded
(the selection indexes the middle store, which must keep every token that left the window).

DoubleSparse++ (project-defined): layers below ``dense_layers`` stay dense; layer ``l`` selects
``k_l = max(k_min, round(k * gamma ** (l - dense_layers)))`` middle tokens; prefill and multi-token
chunks read densely.  Reductions: ``gamma = 1, sinks = window = 0`` is plain DoubleSparse (top-k over
all previous tokens; the current token is always read); ``k`` at least the middle size is dense
attention; ``channels: all`` with 16-bit labels is oracle top-k on the exact scores.

Parameters: ``channels`` ("all", "random" or a channel file), ``r``, ``label_bits`` (16/4/2), ``k``,
``k_min``, ``gamma``, ``dense_layers`` (2), ``sinks`` (4), ``window`` (64), ``seed``, ``group_shared``
(project option, off by default: GQA models select once per KV head from the sum of its query heads'
label scores, so each selected token is gathered once per group and both products run on tensor cores).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from kvcompress import Compressor, CompressorSpec, LabelTopK, Layout, hookimpl, param
from kvcompress.errors import ConfigError, UnsupportedOperationError

CHANNEL_SOURCES = ("all", "random")


@dataclasses.dataclass(frozen=True)
class DoubleSparseConfig:
    channels: str = param("all", "label channels: 'all' (oracle top-k), 'random', or a channel file made by "
                          "`kvcompress calibrate doublesparse`")
    r: int = param(None, "label channels per KV head (default: all of the file's; required for 'random')",
                   type=int, min=1, max=1024, nullable=True)
    label_bits: int = param(16, "bits per label element: 16 (the key dtype) or 4 / 2 (per-token min-max)",
                            choices=(16, 4, 2))
    k: int = param(128, "middle tokens read by the first sparse layer (k0)", min=1, max=1 << 24)
    k_min: int = param(1, "smallest per-layer budget", min=1, max=1 << 24)
    gamma: float = param(1.0, "per-layer budget decay: k_l = max(k_min, round(k * gamma^(l - dense_layers)))",
                         type=float, min=0.0, max=1.0)
    dense_layers: int = param(2, "first layers read densely (l0)", min=0, max=1 << 16)
    sinks: int = param(4, "first real tokens always read (attention sinks)", min=0, max=1 << 20)
    window: int = param(64, "most recent tokens always read (ring buffer)", min=0, max=1 << 20)
    seed: int = param(0, "seed of the 'random' channels", min=0, max=2**31 - 1)
    group_shared: bool = param(False, "GQA: one selection per KV head from the summed label scores of its query "
                               "heads, read once for the group (faster; not in the paper, which selects per "
                               "query head)", type=bool)

    def check(self, path: str) -> None:
        if self.gamma <= 0.0:
            raise ConfigError(f"{path}.gamma", "a number in (0, 1]", self.gamma)
        if self.k_min > self.k:
            raise ConfigError(f"{path}.k_min", f"an integer <= k ({self.k})", self.k_min)
        if self.channels == "random" and self.r is None:
            raise ConfigError(f"{path}.r", "the number of random label channels per KV head", None)
        if self.channels not in CHANNEL_SOURCES and not os.path.isfile(self.channels):
            raise ConfigError(f"{path}.channels", "'all', 'random' or an existing channel file (.safetensors)",
                              self.channels, hint="make one with `kvcompress calibrate doublesparse --channels 16 "
                                                  "--out FILE`")
        if self.channels not in CHANNEL_SOURCES:
            from kvcompress.calibration.doublesparse import load_channels
            from kvcompress.calibration.files import validate_file

            validate_file(f"{path}.channels", load_channels, self.channels)  # all but the model match, before any model
        if self.r is not None and self.label_bits != 16 and (self.r * self.label_bits) % 8:
            raise ConfigError(f"{path}.r", f"a multiple of {8 // self.label_bits} at label_bits "
                              f"{self.label_bits} (codes are packed into bytes)", self.r)

    def budget(self, layer: int) -> int | None:
        """Middle tokens layer ``layer`` reads, or ``None`` for a dense layer."""
        if layer < self.dense_layers:
            return None
        return max(self.k_min, int(round(self.k * self.gamma ** (layer - self.dense_layers))))


class LabelCache:
    """One layer's labels of the middle tokens, in arrival order, stored **channel-major**.

    ``data [B, kv_heads, W, capacity]`` (``W`` = ``r`` label channels in the key dtype, or the ``r * bits / 8``
    packed code bytes of a token) keeps each label channel (or code byte) contiguous over tokens, so the
    fused select kernel reads one channel of every token with coalesced loads; :meth:`labels` hands the
    kernels a ``[B, kv_heads, T, W]`` view of it.  Quantized labels keep their fp16 scale and zero point in
    ``aux [B, kv_heads, 2, capacity]``.  Appends are amortised O(1) (:func:`kvcompress.state.grown_capacity`).
    """

    def __init__(self, channels: torch.Tensor, bits: int):
        self.channels = channels  # [kv_heads, r] on the cache's device
        self.bits = bits
        self.size = 0
        self.all_valid = True
        self.data: torch.Tensor | None = None
        self.aux: torch.Tensor | None = None
        self.valid_mask: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # [capacity] int64, the middle store's token order

    @property
    def capacity(self) -> int:
        return 0 if self.data is None else self.data.shape[-1]

    def _grow(self, needed: int, like: torch.Tensor, aux_like: torch.Tensor | None) -> None:
        from kvcompress.state import grown_capacity

        cap = -(-grown_capacity(self.capacity, needed) // 16) * 16  # aligned rows: vector loads in the kernels
        b, h, w = like.shape[0], like.shape[1], like.shape[-1]
        data = like.new_zeros(b, h, w, cap)
        valid = torch.zeros(b, cap, dtype=torch.bool, device=like.device)
        aux = None if aux_like is None else aux_like.new_zeros(b, h, 2, cap)
        positions = torch.zeros(cap, dtype=torch.long, device=like.device)
        if self.size:
            n = self.size
            data[..., :n] = self.data[..., :n]
            valid[:, :n] = self.valid_mask[:, :n]
            positions[:n] = self.positions[:n]
            if aux is not None:
                aux[..., :n] = self.aux[..., :n]
        self.data, self.valid_mask, self.aux, self.positions = data, valid, aux, positions

    def append(self, k: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, known_valid: bool = False) -> None:
        """Append the labels of ``k``; ``known_valid``: the caller knows every entry of ``valid`` is True
        (:attr:`KVBlock.all_valid`), so no device read decides whether the cache stays all-valid."""
        from kvcompress.kernels.doublesparse import quantize_labels

        b, h, n, _ = k.shape
        if n == 0:
            return
        r = self.channels.shape[1]
        lab = k.gather(-1, self.channels.view(1, h, 1, r).expand(b, h, n, r))
        aux = None
        if self.bits != 16:
            q = quantize_labels(lab, self.bits)
            lab, aux = q.data, torch.stack([q.scale, q.zero], dim=2)  # [B, H, 2, n]
        if self.size + n > self.capacity:
            self._grow(self.size + n, lab, aux)
        sl = slice(self.size, self.size + n)
        self.data[..., sl] = lab.transpose(-1, -2)
        if aux is not None:
            self.aux[..., sl] = aux
        self.valid_mask[:, sl] = valid
        self.positions[sl] = positions
        self.size += n
        if self.all_valid and not known_valid and not bool(valid.all()):
            self.all_valid = False

    def labels(self):
        from kvcompress.kernels.doublesparse import Labels

        n = self.size
        data = self.data[..., :n].transpose(-1, -2)  # [B, H, T, W], token stride 1
        if self.bits == 16:
            return Labels(data, 16)
        return Labels(data, self.bits, self.aux[:, :, 0, :n], self.aux[:, :, 1, :n])

    def valid(self) -> torch.Tensor | None:
        return None if self.all_valid else self.valid_mask[:, :self.size]

    def map_batch(self, fn) -> None:
        if self.data is not None:
            self.data, self.valid_mask = fn(self.data), fn(self.valid_mask)
            if self.aux is not None:
                self.aux = fn(self.aux)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.channels, self.data, self.aux, self.valid_mask,
                                                          self.positions) if t is not None)

    def row_nbytes(self) -> int:
        """The part of :meth:`nbytes` held per row (validity, positions; channels and labels are per head)."""
        return sum(t.numel() * t.element_size() for t in (self.valid_mask, self.positions) if t is not None)


class StaticLabelCache:
    """The label cache of a static cache: preallocated for the middle store's ``capacity`` slots.

    Labels are written at the same ring slots as the middle store writes the block's tokens (both
    advance a device cursor by the block size when the block is due, over the same capacity: a
    :class:`kvcompress.static.StaticRing` each), so a selection's indices are middle-store columns.
    Same channel-major layout as :class:`LabelCache`.  ``selection_heads``: selections per batch row (the query heads,
    or the kv heads when group-shared), for the one-kernel read's rule (its programs).
    """

    def __init__(self, channels: torch.Tensor, bits: int, capacity: int, budget: int, selection_heads: int):
        from kvcompress.static import StaticRing

        self.channels = channels
        self.bits = bits
        self.budget = budget
        self.selection_heads = selection_heads
        self.ring = StaticRing(capacity)
        self.capacity = self.ring.capacity
        self.data: torch.Tensor | None = None  # [B, H, W, capacity]
        self.aux: torch.Tensor | None = None  # [B, H, 2, capacity]
        self.kernel: str | None = None  # the select op's implementation, chosen at allocation
        self.one_kernel: bool | None = None  # whether a read may select and gather in one kernel, chosen then too

    def append(self, block) -> None:
        """Labels of the block's (full-precision) keys, at the ring's cursor."""
        from kvcompress.kernels.ops import quantize_labels  # one opaque op: compiled steps quantize as eager ones
        from kvcompress.static import mark_static

        k = block.k
        b, h, n, _ = k.shape
        r = self.channels.shape[1]
        lab = k.gather(-1, self.channels.view(1, h, 1, r).expand(b, h, n, r))
        aux = None
        if self.bits != 16:
            data, scale, zero = quantize_labels(lab, self.bits)
            lab, aux = data, torch.stack([scale, zero], dim=2)  # [B, H, 2, n]
        if self.data is None:
            self.ring.allocate(b, k.device)
            self.data = lab.new_zeros(b, h, lab.shape[-1], self.capacity)
            self.aux = None if aux is None else aux.new_zeros(b, h, 2, self.capacity)
            mark_static(self.data, self.aux)
            from kvcompress.kernels import ops

            self.kernel = ops.choose("select_topk", k.device, label_bits=self.bits, label_channels=r,
                                     query_dtype=k.dtype, label_dtype=lab.dtype)
            self.one_kernel = self.kernel == "triton" and ops.choose(
                "select_gather", k.device, label_bits=self.bits, label_channels=r, label_dtype=lab.dtype,
                head_dim=k.shape[-1], v_dim=block.v.shape[-1], dtype=k.dtype, query_dtype=k.dtype,
                tokens=self.capacity, k=min(self.budget, self.capacity), rows=b * self.selection_heads) == "triton"
        slots = self.ring.slots(n)
        self.data.index_copy_(3, slots, lab.transpose(-1, -2))
        if aux is not None:
            self.aux.index_copy_(3, slots, aux)
        self.ring.write_meta(slots, block)
        self.ring.advance(n, block.due)

    def labels(self):
        from kvcompress.kernels.doublesparse import Labels

        data = self.data.transpose(-1, -2)
        if self.bits == 16:
            return Labels(data, 16)
        return Labels(data, self.bits, self.aux[:, :, 0], self.aux[:, :, 1])

    def valid(self) -> torch.Tensor | None:
        return self.ring.valid

    def map_batch(self, fn) -> None:
        if self.data is not None:
            from kvcompress.static import remap_rows  # in place unless the row count changes

            self.data, self.ring.valid = remap_rows(self.data, fn), remap_rows(self.ring.valid, fn)
            if self.aux is not None:
                self.aux = remap_rows(self.aux, fn)

    def reset(self) -> None:
        self.ring.reset()

    def nbytes(self) -> int:
        return self.ring.nbytes() + sum(t.numel() * t.element_size() for t in (self.channels, self.data, self.aux)
                                        if t is not None)

    def row_nbytes(self) -> int:
        """The part of :meth:`nbytes` held per row: the slot ring's bookkeeping."""
        return self.ring.nbytes()


class DoubleSparseCompressor(Compressor):
    name = "double_sparse"
    graph_safe = True

    def __init__(self, config: DoubleSparseConfig):
        super().__init__(config)
        self.table: torch.Tensor | None = None  # int64 [layers, kv_heads, r]

    def load(self, model_config, info=None) -> torch.Tensor:
        """Label channels ``[layers, kv_heads, r]`` for ``model_config`` (a file for another model is refused);
        under tensor parallelism the KV heads of ``info``'s rank."""
        if self.table is None:
            from kvcompress.calibration.masks import geometry
            from kvcompress.distributed import local_heads, naming_split

            c = self.config
            layers, kv, d = geometry(model_config)
            if c.channels == "all":
                if c.r not in (None, d):
                    raise ConfigError("double_sparse.r", f"null or head_dim ({d}) with channels 'all'", c.r)
                table = torch.arange(d).expand(layers, kv, d)
            elif c.channels == "random":
                if c.r > d:
                    raise ConfigError("double_sparse.r", f"an integer in [1, head_dim = {d}]", c.r)
                gen = torch.Generator().manual_seed(c.seed)
                table = torch.stack([torch.randperm(d, generator=gen)[:c.r] for _ in range(layers * kv)])
                table = table.view(layers, kv, c.r)
            else:
                from kvcompress.calibration.doublesparse import load_channels

                with naming_split(info):
                    ranked = load_channels(c.channels, model_config).channels
                if c.r is not None and c.r > ranked.shape[-1]:
                    raise ConfigError("double_sparse.r", f"at most the file's {ranked.shape[-1]} channels", c.r)
                table = ranked[..., :c.r] if c.r is not None else ranked
            r = table.shape[-1]
            if c.label_bits != 16 and (r * c.label_bits) % 8:
                raise ConfigError("double_sparse.r", f"a multiple of {8 // c.label_bits} at label_bits "
                                  f"{c.label_bits}", r)
            self.table = local_heads(table.sort(-1).values, info).contiguous()
        return self.table

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        self.load(layer.model_config, layer)  # fail at cache build, not at the first decode step
        return Layout(sinks=self.config.sinks or None, recent=self.config.window, flush=1)

    def _shared(self, q_heads: int, kv_heads: int) -> bool:
        """Whether a layer selects once per kv head (``group_shared`` on a GQA layer) rather than per query head."""
        return self.config.group_shared and q_heads > kv_heads

    def _cache(self, layer, device) -> LabelCache | StaticLabelCache:
        cache = layer.state.get("double_sparse")
        if cache is None:
            channels = self.table[layer.info.index].to(device)
            if layer.static:
                info = layer.info  # selection rows per batch row: kv heads (group-shared) or query heads
                cache = StaticLabelCache(channels, self.config.label_bits, layer.store_capacity,
                                         self.config.budget(info.index),
                                         info.num_kv_heads if self._shared(info.num_q_heads, info.num_kv_heads)
                                         else info.num_q_heads)
            else:
                cache = LabelCache(channels, self.config.label_bits)
            layer.state["double_sparse"] = cache
        return cache

    @hookimpl
    def kvcompress_validate_stack(self, entries, axes):
        for i, ((name, _), axis) in enumerate(zip(entries, axes)):
            if axis == "evict":
                raise ConfigError(f"compressors[{i}].{name}", "no token-evicting compressor in a stack with "
                                  "double_sparse (its selection indexes every middle token)", name,
                                  hint="use double_sparse's own 'sinks' and 'window' instead of an evictor")

    @hookimpl
    def kvcompress_score_tokens(self, layer, block):
        if self.config.budget(layer.info.index) is None:
            return
        if layer.static:  # the store writes the whole block at its cursor; so do the labels
            self._cache(layer, block.k.device).append(block)
            return
        kept = block.compact()  # the columns the middle store will receive (no evictor in the stack)
        if kept is not None:
            self._cache(layer, block.k.device).append(kept.k, kept.valid, kept.positions, kept.all_valid)

    @hookimpl
    def kvcompress_select_tokens(self, layer, query):
        budget = self.config.budget(layer.info.index)
        cache = layer.state.get("double_sparse")
        if layer.static:
            # one shape every step: the top-k over the store's slots (invalid ones score -inf and are
            # masked by the gather), unless the store can never hold more than the budget
            if query.shape[2] != 1 or budget is None or cache is None or cache.capacity <= budget:
                return None
        elif query.shape[2] != 1 or budget is None or cache is None or cache.size <= budget:
            return None  # prefill / chunks, dense layers, or k >= middle tokens: read everything
        elif cache.size != layer.middle.num_tokens:
            raise UnsupportedOperationError(
                f"double_sparse: the middle store holds {layer.middle.num_tokens} tokens but {cache.size} left the "
                "window; DoubleSparse cannot be stacked with an evictor (its selection indexes every middle token)")
        q = query[:, :, 0]
        # static caches chose the kernels once; dynamic ones decide per call
        kernel, one_kernel = getattr(cache, "kernel", None), getattr(cache, "one_kernel", None)
        group = q.shape[1] // cache.channels.shape[0]
        # group-shared: label scores are linear in q, so a kv head's summed scores are those of its summed query,
        # which the select kernels add up as they load it (no separate sum kernel)
        shared = self._shared(q.shape[1], cache.channels.shape[0])
        # the core computes the top-k: with the gather in one kernel where it can (LabelTopK)
        return LabelTopK(q, cache.labels(), cache.channels, cache.valid(), budget, group=group if shared else None,
                         impl=kernel, one_kernel=one_kernel)


@hookimpl
def kvcompress_register_compressors(register):
    register(CompressorSpec(
        name="double_sparse", axis="select", config=DoubleSparseConfig, factory=DoubleSparseCompressor,
        summary="DoubleSparse label-channel top-k selection with sinks, window, layer budgets (arXiv:2408.07092)",
    ))
