"""Tensor parallelism: which KV heads a process holds, and the few decisions that must agree across ranks.

Under transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under ``torchrun``) every rank
runs the attention of a contiguous slice of the heads: ``k_proj`` / ``v_proj`` are split column-wise, so rank
``r`` of ``N`` holds KV heads ``[r * H / N, (r + 1) * H / N)`` of the model's ``H`` (and the query heads of their
groups).  A kvcompress cache built for such a model compresses exactly those heads.  Everything per head stays
local; what is decided from several heads at once must be reduced over the ranks, or ranks would keep different
tokens than one process would:

* a :class:`HeadShard` describes the split; it is made once, when a cache is built
  (:func:`kvcompress.adapters.hf.head_shard` reads it from the model), and travels in
  :attr:`kvcompress.LayerInfo.shard` (``None`` for a model that is not split: no collective ever runs);
* :func:`mean_over_heads` / :func:`sum_over_heads` are the pooling helpers a compressor uses for a score pooled
  over KV heads (PagedEviction's page scores, TOVA's ``heads: layer``): a local sum, one all-reduce over the
  tensor-parallel group (divided by the model's KV heads for the mean);
* :func:`local_heads` slices a per-head calibration tensor (``[..., heads, ...]`` made for the whole model) to
  this rank's heads, and :func:`naming_split` adds the split to a calibration-file error;
* :func:`sum_reports` is the collective memory report: every rank's bytes summed, the dense size of the whole
  model.

Nothing here imports transformers; nothing runs at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """This process' slice of the KV heads under tensor parallelism.

    Attributes:
        rank: this process' index in the tensor-parallel group (``0 .. size - 1``).
        size: ranks in the group.
        kv_heads: KV heads of the whole model (``kv_heads % size == 0``).
        q_heads: query heads of the whole model.
        group: the ``torch.distributed`` process group of the tensor-parallel ranks (``None``: the default group).
    """

    rank: int
    size: int
    kv_heads: int
    q_heads: int
    group: Any = None

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads // self.size

    @property
    def local_q_heads(self) -> int:
        return self.q_heads // self.size

    @property
    def start(self) -> int:
        """The model-wide index of this rank's first KV head."""
        return self.rank * self.local_kv_heads

    @property
    def heads(self) -> slice:
        """This rank's KV heads as a slice of the model's."""
        return slice(self.start, self.start + self.local_kv_heads)

    def describe(self) -> str:
        last = self.start + self.local_kv_heads - 1
        heads = f"KV head {self.start}" if last == self.start else f"KV heads {self.start}-{last}"
        return f"tensor-parallel rank {self.rank} of {self.size} holds {heads} of the model's {self.kv_heads}"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the group's ranks (a new tensor; ``tensor`` is unchanged).  The functional
        collective, so a compiled step can trace it."""
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(tensor, "sum", self.group if self.group is not None else _world())


def torchrun_env(name: str, default: int) -> int:
    """An integer torchrun sets in the environment (``RANK``, ``WORLD_SIZE``), ``default`` when absent or invalid."""
    import os

    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def launched_ranks() -> int:
    """Processes of a ``torchrun`` launch (``WORLD_SIZE``; 1 when not launched by torchrun)."""
    return max(1, torchrun_env("WORLD_SIZE", 1))


def _world() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD


def shard_of(info: Any) -> HeadShard | None:
    """The :class:`HeadShard` of a layer (``None`` when the model is not split over ranks)."""
    shard = getattr(info, "shard", None)
    return shard if shard is not None and shard.size > 1 else None


def sum_over_heads(x: torch.Tensor, info: Any, dim: int = 1, keepdim: bool = False) -> torch.Tensor:
    """The sum of ``x`` over the *model's* KV heads (dimension ``dim`` holds this rank's heads): ``x.sum(dim)`` in one
    process, the local sum all-reduced over the tensor-parallel ranks otherwise."""
    shard = shard_of(info)
    total = x.sum(dim=dim, keepdim=keepdim)
    return total if shard is None else shard.all_reduce(total)


def mean_over_heads(x: torch.Tensor, info: Any, dim: int = 1) -> torch.Tensor:
    """The mean of ``x`` over the *model's* KV heads (dimension ``dim`` holds this rank's heads): ``x.mean(dim)``
    in one process; under tensor parallelism the local sum all-reduced over the ranks, over the model's count, so
    every rank gets the value one process computes (to float rounding)."""
    shard = shard_of(info)
    if shard is None:
        return x.mean(dim=dim)
    return shard.all_reduce(x.sum(dim=dim)) / shard.kv_heads


def local_heads(tensor: torch.Tensor, info: Any, dim: int = 1) -> torch.Tensor:
    """``tensor`` (one entry per KV head of the whole model along ``dim``) narrowed to this rank's heads; unchanged
    in one process.  The caller has checked the tensor against the whole model (its calibration file's model
    identity and head count)."""
    shard = shard_of(info)
    if shard is None:
        return tensor
    return tensor.narrow(dim, shard.start, shard.local_kv_heads)


@contextlib.contextmanager
def naming_split(info: Any) -> Iterator[None]:
    """Re-raise a calibration-file error raised inside with this rank's head split in its message (files hold
    every KV head of the model and each rank slices its own: a file with another head count cannot serve it)."""
    try:
        yield
    except Exception as exc:
        from .calibration.files import CalibrationFileError

        shard = shard_of(info)
        if shard is None or not isinstance(exc, CalibrationFileError):
            raise
        split = (f"the model runs split over {shard.size} ranks and {shard.describe()}: a calibration file holds all "
                 f"{shard.kv_heads} KV heads of the model and each rank uses its own")
        hint = f"{split}; {exc.hint}" if exc.hint else split
        raise type(exc)(exc.file, exc.allowed, exc.got, hint, key=exc.path if exc.path != exc.file else None) from None


def sum_reports(report: Any, shard: HeadShard | None) -> Any:
    """The memory report of the whole model: every rank's segments and dense sizes summed (a collective: every
    rank of the group must call it).  Tokens and rows are the same on every rank.

    The segments are the whole model's cache, as one process would hold it: per-head storage (K, V, codes, scales,
    labels, pruned lanes) adds up over the ranks, and per-row bookkeeping with no head dimension (regions named
    with :data:`kvcompress.state.ROWS`: validity masks, positions, block tables, counters, head-pooled scores) is the
    same on every rank and counted once.  The copies the other ranks hold of it are ``replicated_bytes`` (what the
    ranks hold together is ``cache_bytes + replicated_bytes``).  A bookkeeping region that differs between ranks
    (it should not) is summed like the others.  The dense size is the whole model's."""
    if shard is None or shard.size == 1:
        return report
    import torch.distributed as dist

    gathered: list[Any] = [None] * shard.size
    dist.all_gather_object(gathered, (report.segments, report.dense_fp16_bytes, report.dense_native_bytes),
                           group=shard.group)
    from .state import ROWS

    segments: dict[str, int] = {}
    replicated = 0
    names = {name for part, _, _ in gathered for name in part}
    for name in names:
        values = [part.get(name, 0) for part, _, _ in gathered]
        if name.endswith(ROWS) and len(set(values)) == 1:  # the same bookkeeping on every rank: one copy
            segments[name] = values[0]
            replicated += values[0] * (len(values) - 1)
        else:
            segments[name] = sum(values)
    return dataclasses.replace(report, segments=segments, dense_fp16_bytes=sum(g[1] for g in gathered),
                               dense_native_bytes=sum(g[2] for g in gathered), ranks=shard.size,
                               replicated_bytes=replicated)


__all__ = ["HeadShard", "local_heads", "mean_over_heads", "naming_split", "shard_of", "sum_over_heads", "sum_reports"]
