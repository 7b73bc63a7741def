"""Triton pieces shared by the split-KV decode kernels (KIVI, paged, LeanK).

``combine_splits`` merges ``S`` split partials ``(out, lse)`` by log-sum-exp; ``soft_cap`` applies a logit
soft-cap (Gemma 2) to scores in the kernels' base-2 units; ``scale_in_exponent`` decides which reads take the
query unscaled and apply the softmax scale in the exponent; ``pow2`` and ``num_sms`` size launches;
:func:`occupancy` and :func:`resident_programs` count the programs an SM holds.  Imported only by the kernels'
``triton_kernel`` modules, never at package import.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)`` elementwise (``s`` fp32 scores, ``cap`` > 0 in the same units: a kernel whose scores
    are in base 2 passes ``softcap * log2(e)``).  ``tanh`` from one ``exp2`` of ``-2|x|`` (no overflow, exact
    sign; no libdevice call, so the Triton interpreter runs it too)."""
    x = s / cap
    e = tl.exp2(-2.885390081777927 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


#: the values of a kernel's ``scale_in_exponent`` setting (:func:`scale_in_exponent`)
SCALE_IN_EXPONENT = (False, True, "all")


def check_choice(env: str, key: str, value, allowed: tuple) -> None:
    """A launch configuration's ``key`` entry (read from ``env``) is one of ``allowed`` (e.g.
    :data:`SCALE_IN_EXPONENT`), refused with ``ValueError`` naming the allowed values as JSON writes them."""
    if value not in allowed:
        import json

        raise ValueError(f"{env}: {key}: expected one of {', '.join(json.dumps(a) for a in allowed)}, got {value!r}")


def scale_in_exponent(setting, dtype: torch.dtype) -> bool:
    """Whether a launch over keys of ``dtype`` takes the query unscaled and applies the softmax scale to the fp32
    scores - in the exponent, ``exp2(s * scale - m * scale)``, one FFMA a score as FlashAttention's softmax, with the
    running maximum unscaled until the end - for the setting ``True`` (bf16 keys: rounding the scaled query to bf16's
    8-bit mantissa moved a 4k-token read's LSE by 2.2e-3, session 56), ``"all"`` (every dtype: the same arithmetic
    on fp16 / fp32 keys, which the Triton interpreter can run on a CPU) or ``False`` (none: the scaled query rounded
    to the keys' dtype)."""
    return setting == "all" or (setting is True and dtype == torch.bfloat16)


def cap_base2(softcap: float | None) -> float:
    """The ``cap`` argument of :func:`soft_cap` for scores in base 2 (``0.0``: no soft-cap)."""
    return float(softcap) * LOG2E if softcap else 0.0


LOG2E = 1.4426950408889634


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def env_config(var: str, known) -> dict:
    """The launch settings of the JSON object in environment variable ``var`` (``{}`` when unset), refused with
    ``ValueError`` ``"{var}: unknown entries [...]; known: [...]"`` when an entry is not in ``known`` (a misspelt
    entry would otherwise be ignored in silence)."""
    import json
    import os

    env = os.environ.get(var)
    extra = json.loads(env) if env else {}
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise ValueError(f"{var}: unknown entries {unknown}; known: {sorted(known)}")
    return extra


def power_of_two_setting(var: str, key: str, value, allowed: str, *, zero: bool = False) -> int:
    """A launch setting the kernels build a block from (``value``; ``zero``: 0 also allowed, meaning off), checked
    before any launch: ``ValueError`` ``"{var}: {key} must be {allowed}, got {value!r}"`` otherwise (a block of
    another size fails inside Triton's compiler)."""
    if zero and value == 0:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{var}: {key} must be {allowed}, got {value!r}")
    return value


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(enabled, device: torch.device) -> bool:
    """Whether a split merge is launched with programmatic dependent launch (PDL): asked for (a kernel configuration's
    ``pdl``), on a CUDA device of compute capability 9.0 or newer (``griddepcontrol`` is Hopper PTX; the interpreter
    runs on CPU tensors and never takes it).  With PDL the merge is launched while the split kernel's last wave runs
    (the split kernel's programs signal ``griddepcontrol.launch_dependents`` as they start) and its programs wait in
    ``griddepcontrol.wait`` - until the split kernel has finished and its writes are visible - before they read a
    partial: the merge's launch latency and prologue overlap the split kernel instead of following it (FlashInfer and
    vLLM launch their decode kernels so on Hopper).  Inside a CUDA graph the capture keeps the launch's programmatic
    edge."""
    if not enabled or device.type != "cuda":
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(pdl: bool) -> dict:
    """The launch keyword of a merge kernel launched with PDL (nothing otherwise: an unknown keyword is an error in
    some Triton versions' interpreter)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """``griddepcontrol.wait`` where ``PDL``: everything the previous kernel wrote is visible after it."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """``griddepcontrol.launch_dependents`` where ``PDL``: this program lets a PDL-launched next kernel start."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def fold_splits(top, tot, acc, lse, o):
    """One step of a log-sum-exp merge: the ``[SB]`` LSEs ``lse`` (natural log, ``-inf`` for none) and their
    ``[SB, Dv]`` partials ``o`` folded into the running ``(top, tot, acc)`` (max LSE, weight sum, weighted sum)."""
    new = tl.maximum(top, tl.max(lse, axis=0))
    safe = tl.where(new == float("-inf"), 0.0, new)
    a = tl.exp(top - safe)
    w = tl.exp(lse - safe)
    return new, tot * a + tl.sum(w, axis=0), acc * a + tl.sum(w[:, None] * o, axis=0)


@triton.jit
def _combine_tiles_kernel(PO, PL, OUT, LSE, S, spo_s, spl_s, DV: tl.constexpr, DV_PAD: tl.constexpr,
                          SB: tl.constexpr, PDL: tl.constexpr = False):
    """Log-sum-exp merge of ``S`` split partials of one query row (contiguous ``[S, rows, Dv]`` / ``[S, rows]``),
    ``SB`` splits per step as one ``[SB, Dv]`` tile: the loads of a step are independent, so a row split many ways
    (batch 1: 64-256 splits) waits on ``S / SB`` rounds of loads, not ``S``.  ``PDL``: launched with programmatic
    dependent launch (:func:`use_pdl`): it waits for the split kernel before reading a partial."""
    row = tl.program_id(0).to(tl.int64)  # (batch x head) * M + query row
    offs_s = tl.arange(0, SB)
    offs_d = tl.arange(0, DV_PAD)
    d_ok = offs_d < DV
    pdl_wait(PDL)
    top = tl.max(tl.full([SB], float("-inf"), tl.float32), axis=0)
    tot = tl.sum(tl.zeros([SB], tl.float32), axis=0)
    acc = tl.zeros([DV_PAD], tl.float32)
    for s0 in range(0, S, SB):
        sp = (s0 + offs_s).to(tl.int64)
        s_ok = sp < S
        lse = tl.load(PL + sp * spl_s + row, mask=s_ok, other=float("-inf"))
        o = tl.load(PO + sp[:, None] * spo_s + row * DV + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        top, tot, acc = fold_splits(top, tot, acc, lse, o)
    t_ok = tot > 0.0
    tl.store(OUT + row * DV + offs_d, acc / tl.where(t_ok, tot, 1.0), mask=d_ok)
    tl.store(LSE + row, tl.where(t_ok, top + tl.log(tl.where(t_ok, tot, 1.0)), float("-inf")))


@dataclasses.dataclass(frozen=True)
class SMLimits:
    """What one SM gives its resident programs (an H100 / H200: 65536 registers, 228 KB of shared memory, 2048
    threads, 32 blocks)."""
    registers: int = 65536
    shared: int = 233472
    threads: int = 2048
    blocks: int = 32


def sm_limits(device: torch.device) -> SMLimits:
    """The :class:`SMLimits` of ``device`` (a CUDA device), from its properties."""
    props = torch.cuda.get_device_properties(device)
    return SMLimits(getattr(props, "regs_per_multiprocessor", 65536),
                    getattr(props, "shared_memory_per_multiprocessor", 233472),
                    getattr(props, "max_threads_per_multi_processor", 2048), 32)


def occupancy(regs: int, shared: int, num_warps: int, limits: SMLimits = SMLimits()) -> tuple[int, str]:
    """``(programs, limit)``: how many programs of a kernel that takes ``regs`` registers per thread and ``shared``
    bytes of shared memory one SM holds at a time, and what limits it (``"registers"``, ``"shared"``, ``"threads"``
    or ``"blocks"``; the first of them on a tie).  Registers are allocated per warp, 256 at a time; every block also
    reserves 1 KB of shared memory."""
    warp_regs = -(-max(1, regs) * 32 // 256) * 256
    by = {"registers": limits.registers // (warp_regs * num_warps), "shared": limits.shared // (shared + 1024),
          "threads": limits.threads // (32 * num_warps), "blocks": limits.blocks}
    limit = min(by, key=lambda k: by[k])
    return max(1, by[limit]), limit


def resident_programs(kernel, args, consts: dict, num_warps: int, num_stages: int, device: torch.device,
                      cache: dict) -> int:
    """How many programs of ``kernel`` (a ``@triton.jit`` function, launched with ``args`` - a tuple, or a callable
    returning it - and the constexprs ``consts``) one SM runs at a time, from the compiled kernel's registers and
    shared memory (:func:`occupancy`): its first use compiles it, ahead of the launch.  Cached in ``cache`` per
    (device, constexprs, warps, stages): the same compiled function for every call of one configuration.
    ``tests/test_paged_kernel.py`` checks it against the CUDA driver's occupancy calculator."""
    key = (device.index, tuple(sorted(consts.items())), num_warps, num_stages)
    if key not in cache:
        if callable(args):  # built only for the first use (a decode step's launches skip the argument tuple)
            args = args()
        compiled = kernel.warmup(*args, grid=(1, 1, 1), num_warps=num_warps, num_stages=num_stages, **consts)
        compiled._init_handles()
        cache[key] = occupancy(compiled.n_regs, compiled.metadata.shared, num_warps, sm_limits(device))[0]
    return cache[key]


#: the most splits a row's merge folds per step (:func:`_combine_tiles_kernel`)
COMBINE_TILE_SPLITS = 32


def combine_splits(po: torch.Tensor, pl: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, splits: int,
                   rows: int, dv: int, pdl: bool = False) -> None:
    """Merge contiguous partials ``po [S, rows, Dv]`` / ``pl [S, rows]`` (``rows``: batch x heads x query rows)
    into ``out`` / ``lse`` (contiguous ``[rows, Dv]`` / ``[rows]``): one program per row, folding up to
    :data:`COMBINE_TILE_SPLITS` splits per step (:func:`_combine_tiles_kernel`).  ``pdl``: launched with
    programmatic dependent launch (the caller checked :func:`use_pdl`; its split kernel triggers it)."""
    _combine_tiles_kernel[(rows,)](
        po, pl, out, lse, splits, po.stride(0), pl.stride(0),
        DV=dv, DV_PAD=max(16, pow2(dv)), SB=max(2, min(COMBINE_TILE_SPLITS, pow2(splits))), PDL=pdl, num_warps=4,
        **pdl_launch(pdl))
