"""A split count per lane for split-KV reads over lanes of unequal width (pure arithmetic, no device).

A read over LeanK's lanes (or the KIVI lanes of a stacked LeanK + KIVI layer) gives every (lane head, token split) a
program or CTA.  With one split count for every lane, a program of a 96-channel lane reads 1.4x the bytes of a
32-channel lane's, so within one wave of programs the narrow lanes finish early and the widest sets the read's span.
:func:`lane_splits` gives each lane its own count within the same budget of programs: the costliest lane's programs
get one more split at a time (FlashInfer's and FlashAttention's split-KV decoders split by work, not by count, in the
same spirit).  Used by :mod:`kvcompress.kernels.kivi.lanes_cuda` (``lane_balance``, the default since session 54) and
:mod:`kvcompress.kernels.leank.triton_kernel` (``lane_balance``, opt-in).
"""

from __future__ import annotations

from typing import Sequence


def lane_splits(lanes: Sequence[tuple[float, int, int]], rows: int, budget: int, most: int) -> list[int]:
    """Splits per lane: ``lanes`` lists ``(cost of one tile, heads, tiles)``; ``rows`` the programs one head's split
    takes (batch x row blocks); ``budget`` the programs all lanes may have (about one wave); ``most`` the most splits
    of any lane (each program's minimum of tiles; a lane also never has more splits than tiles).

    A program of lane ``i`` at ``s`` splits costs ``cost_i x ceil(tiles_i / s)``.  Starting from one split per lane,
    the lane whose programs cost most gets one more split while all lanes' programs stay within ``budget``; a lane at
    its cap gets no more and the next costliest goes on.  So where the cap binds before the budget (batch 1, short
    contexts) every lane reaches it, as a uniform count would, and where the budget binds the wider lanes get more."""
    s = [1] * len(lanes)
    used = sum(heads * rows for _, heads, _ in lanes)
    caps = [max(1, min(most, tiles)) for _, _, tiles in lanes]
    while True:
        room = [j for j in range(len(lanes)) if s[j] < caps[j]]
        if not room:
            return s
        i = max(room, key=lambda j: lanes[j][0] * -(-lanes[j][2] // s[j]))
        extra = lanes[i][1] * rows
        if used + extra > budget:
            return s
        s[i] += 1
        used += extra


__all__ = ["lane_splits"]
