"""KIVI: tuning-free asymmetric 2-bit / 4-bit KV-cache quantization.

Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu. *KIVI: A Tuning-Free Asymmetric
2bit Quantization for KV Cache.* ICML 2024, arXiv:2402.02750.

Keys (after RoPE) are quantized **per channel** - a group is ``group`` (G)
consecutive tokens of one channel, since key outliers live in fixed channels -
and values **per token** (a group is G consecutive channels of one token).
Asymmetric min-max with an fp16 scale and zero point, ``bits`` = 2 or 4.

The newest ``residual`` (R) tokens stay in full precision in the layer's recent
ring; every time G more tokens arrive, the oldest G leave the residual and are
quantized as one key group (their values token by token) and **appended** to a
packed store: stored codes are never dequantized or re-quantized (transformers'
``QuantizedCache`` re-quantizes its whole cache on every flush).  The store packs
``32 / bits`` codes per int32 word, preallocates with amortised (geometric) growth
and, under an upstream token budget, reuses freed groups as a ring.  A 2-bit,
G = 32 store costs ``2 + 32/32 = 3`` bits per element.

Values leave the residual in the same G-token blocks as keys (so a token is
either fully precise or fully quantized); the official code quantizes values
one token at a time as soon as they pass R, so ours keeps up to G - 1 more
full-precision values.  Optional full-precision attention ``sinks`` (the first
real tokens) roughly halve the 2-bit penalty on small models.

KIVI is the last stage of a stack: it quantizes whatever an evictor, pruner or
regrouper upstream hands it.  Evictors free memory in whole G-token groups:
evicted tokens are masked at once and their group is released when no row keeps
any of its tokens.

Attention: the PyTorch reference dequantizes at read time; on CUDA a Triton
kernel reads the packed codes in place (``kvcompress.kernels.kivi``), merged with
the full-precision regions by log-sum-exp.  Stacked after a regrouping pruner (LeanK),
the store holds one lane per head group; those lanes are read as ONE region
(:class:`~kvcompress.kernels.kivi.PackedLanes`, op ``kvcompress::kivi_lanes_partial``:
one Triton launch plus one merge on CUDA, whatever the number of lanes; the reference on
the CPU), planned once when the lanes are made (:class:`MergedLanes`).

Parameters: ``bits`` (2), ``group`` (32), ``residual`` (128), ``sinks`` (0),
``key_axis`` ("channel"; "token" is the paper's ablation of the wrong axis).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from kvcompress import Compressor, CompressorSpec, Layout, hookimpl, param
from kvcompress.errors import ConfigError
from kvcompress.kernels.kivi import KiviLane, PackedKV, PackedLanes
from kvcompress.state import ROWS, HeadGroup, KVBlock, MiddleStore, Segment, grown_capacity
from kvcompress.static import StaticRingStore, mark_static


@dataclasses.dataclass(frozen=True)
class KiviConfig:
    bits: int = param(2, "bits per quantized element", choices=(2, 4))
    group: int = param(32, "tokens per key group and channels per value group (G)", choices=(16, 32, 64, 128))
    residual: int = param(128, "most recent tokens kept in full precision (R, a multiple of group)", min=0,
                          max=1 << 20)
    sinks: int = param(0, "first real tokens of each row kept in full precision (attention sinks)", min=0,
                       max=1 << 20)
    key_axis: str = param("channel", "key quantization axis: 'channel' is KIVI; 'token' is the paper's ablation "
                          "(quantizing keys per token, known to be much worse)", choices=("channel", "token"))

    def check(self, path: str) -> None:
        if self.residual % self.group:
            raise ConfigError(f"{path}.residual", f"a multiple of group ({self.group})", self.residual,
                              hint="KIVI quantizes keys one group of G tokens at a time")


class KiviCodec:
    """Encodes blocks of ``G``-aligned tokens into KIVI payload tensors (no storage policy).

    Every payload tensor is ``[batch, heads, n, ...]`` where ``n`` counts tokens
    (:meth:`token_axis` is True: values, and keys in the per-token ablation) or
    G-token groups (per-channel keys).  Stores (the ring below, a paged pool) decide
    where payloads live; :meth:`packed` turns views of them back into a
    :class:`~kvcompress.kernels.kivi.PackedKV` that attention reads in place.
    """

    names = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")

    def __init__(self, config: KiviConfig, head_dim: int):
        self.bits, self.group = config.bits, config.group
        self.per_token_keys = config.key_axis == "token"
        self.v_group = math.gcd(config.group, head_dim)

    @property
    def unit(self) -> int:
        """Tokens per encoding unit (blocks must be a multiple of it)."""
        return self.group

    def token_axis(self, name: str) -> bool:
        return name.startswith("v_") or (self.per_token_keys and name.startswith("k_"))

    def encode(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
               fill: bool | None = None, impl: str = "reference") -> dict[str, torch.Tensor]:
        """Quantize ``k``/``v`` ``[batch, heads, T, d]`` (T a multiple of G); masked slots never widen a range.

        ``fill``: replace masked slots (``None``: only when some slot is masked, a host check; static
        caches pass ``True``, which changes nothing where every slot is valid).  ``impl``: the
        ``kvcompress::kivi_quantize`` implementation (:meth:`choose_quantizer`; ``"triton"`` on CUDA only)."""
        masked = valid if fill or (fill is None and not bool(valid.all())) else None
        from kvcompress.kernels.ops import kivi_quantize  # one opaque op: compiled steps quantize as eager ones

        out = kivi_quantize(k, v, masked, self.bits, self.group, self.v_group, self.per_token_keys, impl)
        return dict(zip(self.names, out))

    def choose_quantizer(self, k: torch.Tensor, v: torch.Tensor) -> str:
        """The ``kvcompress::kivi_quantize`` implementation for blocks shaped like ``k`` / ``v`` (static stores:
        once, at allocation; the dynamic store: per call)."""
        from kvcompress.kernels import ops

        return ops.choose("kivi_quantize", k.device, bits=self.bits, group=self.group, v_group=self.v_group,
                          head_dim=k.shape[-1], v_dim=v.shape[-1], k_per_token=self.per_token_keys, dtype=k.dtype)

    def packed(self, payload: dict[str, torch.Tensor], valid: torch.Tensor, impl: str | None = None,
               length: torch.Tensor | None = None) -> PackedKV:
        """A :class:`PackedKV` over ``payload``; ``impl`` / ``length``: its kernel, chosen when a static store
        was built, and the device-side count of leading slots that may be live (see :class:`PackedKV`)."""
        return PackedKV(self.bits, self.group, *(payload[n] for n in self.names), valid,
                        k_per_token=self.per_token_keys, impl=impl, length=length)

    def choose_kernel(self, payload: dict[str, torch.Tensor], tokens: int) -> str:
        """The ``kvcompress::kivi_partial`` implementation for these payloads (decided once, at allocation)."""
        from kvcompress.kernels import ops

        per = 32 // self.bits
        dk = payload["k_scale"].shape[-1]
        dv = payload["v_codes"].shape[-1] * per
        return ops.choose("kivi_partial", payload["k_codes"].device, bits=self.bits, group=self.group, head_dim=dk,
                          v_dim=dv, v_group=self.v_group, k_per_token=self.per_token_keys, tokens=tokens)

    @staticmethod
    def report_key(name: str) -> str:
        return "middle: kivi codes" if name.endswith("codes") else "middle: kivi scales"


#: batch x kv heads and slots from which a static CUDA store reads its lanes one by one instead of merged (H200,
#: LeanK-70 + KIVI-2, docs/results.md "Session 18"): merged faster at Llama B1-B16 and SmolLM2 B16-B64 (<= 192 rows
#: x heads) and at Llama B64 / 4k (341 vs 422 us); per-lane at Llama B64 / 32k and 128k (1.09x / 1.36x SDPA against
#: 0.93x / 0.98x merged)
MERGE_MAX_ROW_HEADS = 512
PER_LANE_MIN_TOKENS = 16384


@dataclasses.dataclass
class MergedLanes:
    """How a store's head-group lanes read as one region (a stacked LeanK + KIVI middle): decided once, when the
    lanes are made, from host facts (one read of the lanes' head lists), never per step.

    ``heads``: the kv heads the region's segment covers (``None``: every kv head, in order - always, when the
    layer's kv head count is known); ``lane_heads``: each lane's heads as positions among them; ``num_heads``: their
    count; ``impl``: the ``kvcompress::kivi_lanes_partial`` implementation (:func:`kvcompress.kernels.ops.choose`).
    ``covered``: bool ``[num_heads]`` when some head has no lane (a pruner dropped it: it keeps no middle), else
    ``None``.  The segment then covers every head anyway - the op gives such a head ``-inf`` - and its validity is
    per head (``[batch, heads, tokens]``, those heads never valid), which is what the readers that decode the region
    instead (read-time selections, attention-mass observers) mask with; so the read needs no gather of the query's
    heads and no scatter of the partial.
    """

    heads: torch.Tensor | None
    lane_heads: list[torch.Tensor | None]
    num_heads: int
    head_dim: int
    impl: str
    covered: torch.Tensor | None = None

    @classmethod
    def plan(cls, codec: "KiviCodec", groups: list[HeadGroup], payloads: list[dict[str, torch.Tensor]],
             head_dim: int, num_kv_heads: int | None, tokens: int | None = None) -> "MergedLanes | None":
        """The plan, or ``None`` when the lanes stay separate segments: per-token keys, lanes with a query
        projection or an output map (low rank), lanes sharing a head, a CUDA store whose fused kernel does not take
        them (the per-lane KIVI kernels then read them as before), a static CUDA store (``tokens``: its slots) of at
        least :data:`MERGE_MAX_ROW_HEADS` rows x kv heads and :data:`PER_LANE_MIN_TOKENS` slots whose merged read
        would be the Triton lanes kernel (the per-lane reads are faster there; the CUDA lanes kernel keeps it), or a single lane that gains nothing (every head, all channels) or that the KIVI CUDA
        kernel (v3) reads on its own."""
        if not groups or codec.per_token_keys:
            return None
        if any(g.heads is None or g.qmap is not None or g.vmap is not None for g in groups):
            return None
        if any(g.channels is None and p["k_scale"].shape[-1] != head_dim for g, p in zip(groups, payloads)):
            return None
        lists = [g.heads.tolist() for g in groups]  # one host read, once per store
        union = sorted(h for hs in lists for h in hs)
        if len(set(union)) != len(union) or (num_kv_heads is not None and union[-1] >= num_kv_heads):
            return None  # a head in two lanes: the segments' dequantized keys could not hold it
        from kvcompress.kernels import ops

        device = groups[0].heads.device
        dv = payloads[0]["v_codes"].shape[-1] * (32 // codec.bits)
        impl = ops.choose("kivi_lanes_partial", device, bits=codec.bits, group=codec.group, head_dim=head_dim,
                          v_dim=dv, v_group=codec.v_group, kept=tuple(p["k_scale"].shape[-1] for p in payloads))
        if device.type == "cuda" and impl == "reference":
            return None  # the per-lane KIVI kernels beat the reference on the GPU
        rows = payloads[0]["v_codes"].shape[0] * (num_kv_heads or len(union))
        if impl == "triton" and rows >= MERGE_MAX_ROW_HEADS and tokens is not None and tokens >= PER_LANE_MIN_TOKENS:
            return None  # large, long static stores: the per-lane reads (KIVI CUDA v3 where it takes a lane) beat the
            # Triton lanes kernel there (measured before the CUDA lanes kernel, which takes the merged read)
        if len(groups) == 1:  # one lane: merged where it spares the read a query gather / head scatter
            g = groups[0]
            if g.every_head and g.channels is None:
                return None
            if device.type == "cuda" and codec.choose_kernel(payloads[0], payloads[0]["v_codes"].shape[2]) == "cuda":
                return None  # the KIVI CUDA kernel (v3) reads one lane faster than the lanes kernel's v2 loop
        if num_kv_heads is not None:
            covered = None
            if len(union) != num_kv_heads:
                covered = torch.zeros(num_kv_heads, dtype=torch.bool)
                covered[union] = True
                covered = covered.to(device)
            # a lane of every head in order reads the query as it is (no head list)
            return cls(None, [None if g.every_head else g.heads for g in groups], num_kv_heads, head_dim, impl,
                       covered)
        where = {h: i for i, h in enumerate(union)}
        lane_heads = [torch.tensor([where[h] for h in hs], dtype=torch.long, device=device) for hs in lists]
        return cls(torch.tensor(union, dtype=torch.long, device=device), lane_heads, len(union), head_dim, impl)

    def region(self, codec: "KiviCodec", groups: list[HeadGroup], payloads: list[dict[str, torch.Tensor]],
               valid: torch.Tensor, impl: str | None = None) -> PackedLanes:
        lanes = tuple(KiviLane(heads, g.channels, *(p[name] for name in codec.names))
                      for heads, g, p in zip(self.lane_heads, groups, payloads))
        return PackedLanes(codec.bits, codec.group, lanes, valid, self.num_heads, self.head_dim,
                           impl=self.impl if impl is None else impl)

    def segment(self, region: PackedLanes, valid: torch.Tensor, positions: torch.Tensor,
                head_valid: torch.Tensor | None = None) -> Segment:
        """The region's segment.  With heads without a lane its validity is per head: ``head_valid`` where the store
        keeps ``valid & covered`` up to date as it writes (a static store: no op per read), else made here."""
        if self.covered is not None:  # heads without a lane: never valid
            valid = head_valid if head_valid is not None else valid.unsqueeze(1) & self.covered.view(1, -1, 1)
        return Segment(None, None, valid, positions, heads=self.heads, packed=region)

    def head_valid(self, valid: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor | None:
        """``valid & covered`` (``[batch, heads, tokens]``) written into ``out`` (allocated here when missing or of
        another shape), or ``None`` when every head has a lane."""
        if self.covered is None or valid is None:
            return None
        shape = (valid.shape[0], self.covered.shape[0], valid.shape[1])
        if out is None or tuple(out.shape) != shape or out.device != valid.device:
            out = torch.empty(shape, dtype=torch.bool, device=valid.device)
            mark_static(out)
        return torch.logical_and(valid.unsqueeze(1), self.covered.view(1, -1, 1), out=out)


class KiviStore(MiddleStore):
    """Packed, append-only store of quantized middle tokens: a growable ring of G-token groups.

    One lane of packed tensors per head group of the incoming blocks (one lane for
    all heads unless a pruner regrouped them); the ring indices and the per-row
    ``valid`` mask are shared by every lane.
    """

    def __init__(self, config: KiviConfig, head_dim: int, num_kv_heads: int | None = None):
        self.codec = KiviCodec(config, head_dim)
        self.group = self.codec.group
        self.head_dim, self.num_kv_heads = head_dim, num_kv_heads
        self.merged: MergedLanes | None = None  # the lanes read as one region (planned when they are made)
        self.start = 0  # first live group slot
        self.groups = 0  # live groups
        self.max_groups: int | None = None
        self.lanes: list[tuple[HeadGroup, dict[str, torch.Tensor]]] | None = None
        self.valid: torch.Tensor | None = None  # [batch, capacity * G]
        self._segments: list[Segment] | None = None  # views built once per change of the store (decode reads them)

    # -- capacity ---------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.valid.shape[1] // self.group if self.valid is not None else 0

    def limit(self, max_tokens: int) -> None:
        # +1: the oldest group may still hold a kept token while the newest fills.
        self.max_groups = math.ceil(max_tokens / self.group) + 1

    def _token_dim(self, name: str) -> bool:
        return self.codec.token_axis(name)

    def _resized(self, t: torch.Tensor, name: str, groups: int) -> torch.Tensor:
        shape = list(t.shape)
        dim = 1 if name == "valid" else 2
        shape[dim] = groups * self.group if (name == "valid" or self._token_dim(name)) else groups
        return t.new_zeros(shape)

    def _group_slots(self, first: int, n: int) -> torch.Tensor:
        return (torch.arange(n, device=self.valid.device) + self.start + first) % self.capacity

    def _token_slots(self, group_slots: torch.Tensor) -> torch.Tensor:
        offs = torch.arange(self.group, device=group_slots.device)
        return (group_slots.unsqueeze(1) * self.group + offs).flatten()

    def _tensors(self):
        """(name, lane dict or None for the shared mask) of every buffer."""
        yield "valid", None
        for _, bufs in self.lanes:
            for name in bufs:
                yield name, bufs

    def _ensure(self, new_groups: int) -> None:
        self._segments = None
        needed = self.groups + new_groups
        if needed <= self.capacity:
            return
        cap = grown_capacity(self.capacity, needed, unit=self.group, limit=self.max_groups)
        gs = self._group_slots(0, self.groups)
        ts = self._token_slots(gs)
        for name, bufs in list(self._tensors()):
            old = self.valid if bufs is None else bufs[name]
            new = self._resized(old, name, cap)
            dim = 1 if name == "valid" else 2
            idx = ts if (name == "valid" or self._token_dim(name)) else gs
            new.narrow(dim, 0, idx.numel()).copy_(old.index_select(dim, idx))
            if bufs is None:
                self.valid = new
            else:
                bufs[name] = new
        self.start = 0

    # -- MiddleStore -------------------------------------------------------------------
    def append(self, block: KVBlock) -> None:
        self._segments = None
        valid = block.valid
        pad = (-block.num_tokens) % self.group
        if pad:  # a block cut by eviction: fill the last group with masked slots
            valid = torch.cat([valid, valid.new_zeros(valid.shape[0], pad)], dim=1)
        encoded = []
        for part in block.parts():
            k, v = part.k, part.v
            if pad:
                k = torch.cat([k, k[:, :, -1:].expand(-1, -1, pad, -1)], dim=2)
                v = torch.cat([v, v[:, :, -1:].expand(-1, -1, pad, -1)], dim=2)
            encoded.append((part, self.codec.encode(k, v, valid, impl=self.codec.choose_quantizer(k, v))))
        n = valid.shape[1] // self.group
        if self.lanes is None:
            self.lanes = [(part.layout(), {name: self._resized(t, name, n) for name, t in data.items()})
                          for part, data in encoded]
            self.valid = self._resized(valid, "valid", n)
            self.merged = MergedLanes.plan(self.codec, [g for g, _ in self.lanes], [b for _, b in self.lanes],
                                           self.head_dim, self.num_kv_heads)
        self._ensure(n)
        gs = self._group_slots(self.groups, n)
        ts = self._token_slots(gs)
        self.valid.index_copy_(1, ts, valid)
        for (_, bufs), (_, data) in zip(self.lanes, encoded):
            for name, src in data.items():
                bufs[name].index_copy_(2, ts if self._token_dim(name) else gs, src)
        self.groups += n

    def _extent(self) -> int:
        """Group slots attention must scan: the live ones, plus freed ones when the ring wraps."""
        return self.capacity if self.start + self.groups > self.capacity else self.start + self.groups

    def segments(self) -> list[Segment]:
        if self.groups == 0:
            return []
        if self._segments is None:
            self._segments = self._build_segments()
        return self._segments

    def _build_segments(self) -> list[Segment]:
        e = self._extent()
        valid = self.valid[:, : e * self.group]
        # Middle tokens precede every query: their positions never mask anything.
        positions = torch.zeros((), dtype=torch.long, device=valid.device).expand(valid.shape[1])

        def cut(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {name: b[name][:, :, : e * self.group] if self._token_dim(name) else b[name][:, :, :e]
                    for name in self.codec.names}

        if self.merged is not None:  # every lane in one region: one read
            region = self.merged.region(self.codec, [g for g, _ in self.lanes], [cut(b) for _, b in self.lanes], valid)
            return [self.merged.segment(region, valid, positions)]
        return [group.attach(Segment(None, None, valid, positions, packed=self.codec.packed(cut(b), valid)))
                for group, b in self.lanes]

    @property
    def num_tokens(self) -> int:
        return self.groups * self.group

    def valid_mask(self) -> torch.Tensor | None:
        if self.groups == 0:
            return None
        return self.valid[:, self._token_slots(self._group_slots(0, self.groups))]

    def retain(self, keep: torch.Tensor) -> None:
        ts = self._token_slots(self._group_slots(0, self.groups))
        self.valid[:, ts] = self.valid[:, ts] & keep
        alive = keep.view(keep.shape[0], self.groups, self.group).any(dim=2).any(dim=0)
        dead = int(alive.long().argmax()) if bool(alive.any()) else self.groups
        self._free(dead)

    def drop_oldest(self, n: int) -> None:
        if n % self.group:
            raise ValueError(f"KIVI evicts whole groups of {self.group} tokens; cannot drop {n}")
        self._free(min(n // self.group, self.groups))

    def _free(self, groups: int) -> None:
        if groups <= 0:
            return
        self._segments = None
        self.valid[:, self._token_slots(self._group_slots(0, groups))] = False
        self.start = (self.start + groups) % self.capacity
        self.groups -= groups

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._segments = None
        if self.lanes is not None:
            self.valid = fn(self.valid)
            self.lanes = [(group, {name: fn(t) for name, t in bufs.items()}) for group, bufs in self.lanes]

    def nbytes(self) -> dict[str, int]:
        out = {"middle: kivi codes": 0, "middle: kivi scales": 0,
               "middle: mask" + ROWS: self.valid.numel() if self.valid is not None else 0}
        for _, bufs in self.lanes or []:
            for name, t in bufs.items():
                out[self.codec.report_key(name)] += t.numel() * t.element_size()
        return out


class KiviStaticStore(StaticRingStore):
    """KIVI's store in a static cache: packed tensors preallocated for ``capacity`` tokens, used as a
    ring of G-token groups with a device-side cursor (:class:`kvcompress.static.StaticRingStore`).

    Same payloads and segments as :class:`KiviStore`; blocks arrive G-aligned (a static cache's flush
    is a multiple of G) and are encoded once, append-only; eviction masks slots (``retain``) and the
    cursor reuses the oldest groups.
    """

    def __init__(self, config: KiviConfig, head_dim: int, capacity: int, num_kv_heads: int | None = None):
        self.codec = KiviCodec(config, head_dim)
        self.group = self.codec.group
        super().__init__(capacity, unit=self.group)
        self.head_dim, self.num_kv_heads = head_dim, num_kv_heads
        self.merged: MergedLanes | None = None  # the lanes read as one region (planned at allocation)
        self.lanes_kernel: str | None = None  # its kvcompress::kivi_lanes_partial implementation, chosen then
        self._region: PackedLanes | None = None  # built once (the buffers are static), without the live length
        # the merged region's per-head validity (valid & covered, where a head has no lane), rewritten whenever the
        # ring's validity changes - by this store's own writes (flush steps), not by every read
        self._head_valid: torch.Tensor | None = None
        self.kernels: list[str] = []  # per lane, chosen at allocation
        self.quantizers: list[str] = []  # per lane: the kvcompress::kivi_quantize implementation, chosen with them

    def append(self, block: KVBlock) -> None:
        if block.slots is None:
            block = self.ring.fit(block)
        n, g = block.num_tokens, self.group
        if n % g:
            raise ValueError(f"a static KIVI store encodes whole groups of {g} tokens, got a block of {n}")
        parts = block.parts()
        if self.lanes is None:
            self.quantizers = [self.codec.choose_quantizer(part.k, part.v) for part in parts]
        encoded = [(part, self.codec.encode(part.k, part.v, block.valid, fill=True, impl=impl))
                   for part, impl in zip(parts, self.quantizers)]
        if self.lanes is None:
            self.ring.allocate(block.valid.shape[0], block.valid.device)
            self.lanes = []
            for part, data in encoded:
                bufs = {}
                for name, t in data.items():
                    shape = list(t.shape)
                    shape[2] = self.ring.columns if self.codec.token_axis(name) else self.ring.columns // g
                    bufs[name] = t.new_zeros(shape)
                    mark_static(bufs[name])
                self.lanes.append((part.layout(), bufs))
            self._plan_reads()
        if block.slots is not None:  # slot mode: per-head unit targets chosen by the evictor (whole G-token groups)
            target = self.ring.route(block)  # [b, heads, n] token columns, unit-aligned
            b, h = target.shape[0], target.shape[1]
            units = target.view(b, h, n // g, g)[..., 0].div(g, rounding_mode="floor")
            for (group, bufs), (_, data) in zip(self.lanes, encoded):
                t_tok = target if group.heads is None else target.index_select(1, group.heads)
                t_unit = units if group.heads is None else units.index_select(1, group.heads)
                for name, src in data.items():
                    index = t_tok if self.codec.token_axis(name) else t_unit
                    index = index.view(*index.shape, *([1] * (src.dim() - 3))).expand_as(src)
                    bufs[name].scatter_(2, index, src)
            self.ring.write_slots(target, block)
            return
        tslots = self.ring.slots(n)
        gslots = tslots.view(n // g, g)[:, 0].div(g, rounding_mode="floor")
        for (_, bufs), (_, data) in zip(self.lanes, encoded):
            for name, src in data.items():
                bufs[name].index_copy_(2, tslots if self.codec.token_axis(name) else gslots, src)
        self.ring.write_meta(tslots, block)
        self.ring.advance(n, block.due)
        self._sync_head_valid()

    def _sync_head_valid(self) -> None:
        """Rewrite the merged region's per-head validity after the ring's validity changed (in place: its address
        stays what a captured graph reads)."""
        merged = self.merged if not self.slotted else None
        self._head_valid = None if merged is None else merged.head_valid(self.ring.valid, self._head_valid)

    def retain(self, keep: torch.Tensor) -> None:
        super().retain(keep)
        self._sync_head_valid()

    def reset(self) -> None:
        super().reset()
        self._sync_head_valid()

    def _plan_reads(self) -> None:
        """Each lane's KIVI kernel and, outside slot mode, the merged read of the lanes: chosen once for the
        buffers' shapes (when they are allocated, and again if :meth:`shrink` replaced them)."""
        self.kernels = [self.codec.choose_kernel(bufs, self.ring.columns) for _, bufs in self.lanes]
        if not self.slotted:  # slot mode (an evictor places blocks per head) keeps one segment per lane
            self.merged = MergedLanes.plan(self.codec, [g for g, _ in self.lanes], [b for _, b in self.lanes],
                                           self.head_dim, self.num_kv_heads, tokens=self.ring.columns)
            self.lanes_kernel = None if self.merged is None else self.merged.impl
            self._region = None if self.merged is None else self.merged.region(
                self.codec, [g for g, _ in self.lanes], [b for _, b in self.lanes], self.ring.valid)
        self._sync_head_valid()

    def shrink(self, capacity: int) -> bool:
        if not super().shrink(capacity):
            return False
        if self.lanes is not None:
            self._plan_reads()
        return True

    def segments(self) -> list[Segment]:
        if self.lanes is None:
            return []
        valid, positions = self.ring.valid, self.ring.zero_pos
        # slots past the cursor were never written (slot mode: the evictor writes anywhere); a length past the
        # capacity (the ring wrapped) bounds nothing - every reader takes min(length, slots) - so no clamp op per read
        live = None if self.slotted else self.ring.cursor
        if self.merged is not None:  # every lane in one region: one read
            region = self._region
            if region is None or region.impl != self.lanes_kernel:  # (map_batch drops it: new buffers)
                region = self._region = self.merged.region(self.codec, [g for g, _ in self.lanes],
                                                           [b for _, b in self.lanes], valid, self.lanes_kernel)
            return [self.merged.segment(region.with_length(live), valid, positions, self._head_valid)]
        return [group.attach(Segment(None, None, valid, positions,
                                     packed=self.codec.packed(bufs, valid, impl=impl, length=live)))
                for (group, bufs), impl in zip(self.lanes, self.kernels)]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().map_batch(fn)
        self._region = None  # rows repeated or selected: new buffers
        self._head_valid = None
        self._sync_head_valid()

    def nbytes(self) -> dict[str, int]:
        out = {"middle: kivi codes": 0, "middle: kivi scales": 0, "middle: mask + positions" + ROWS: self._meta_bytes()}
        for _, bufs in self.lanes or []:
            for name, t in bufs.items():
                out[self.codec.report_key(name)] += t.numel() * t.element_size()
        return out


class KiviCompressor(Compressor):
    name = "kivi"
    graph_safe = True

    @hookimpl
    def kvcompress_layer_layout(self, layer):
        return Layout(sinks=self.config.sinks or None, recent=self.config.residual, flush=self.config.group)

    @hookimpl
    def kvcompress_quantize_store(self, layer):
        if layer.static:
            return KiviStaticStore(self.config, layer.info.head_dim, layer.store_capacity, layer.info.num_kv_heads)
        lay = layer.layout
        if lay.head_slots and lay.middle is not None:
            # an evictor places blocks per head under a bound (decoding under a budget): the preallocated store,
            # sized by the bound, is the one with per-head slots (whole G-token groups) - in a dynamic cache too
            return KiviStaticStore(self.config, layer.info.head_dim, -(-lay.middle // self.config.group)
                                   * self.config.group, layer.info.num_kv_heads)
        return KiviStore(self.config, layer.info.head_dim, layer.info.num_kv_heads)

    @hookimpl
    def kvcompress_middle_codec(self, layer):
        return KiviCodec(self.config, layer.info.head_dim)


@hookimpl
def kvcompress_register_compressors(register):
    register(CompressorSpec(
        name="kivi", axis="quantize", config=KiviConfig, factory=KiviCompressor,
        summary="KIVI 2/4-bit KV quantization, keys per channel, values per token (arXiv:2402.02750)",
    ))
