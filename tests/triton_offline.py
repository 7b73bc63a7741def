"""Compile the Triton kernels a CPU call launches, for a GPU target, without a GPU.

:func:`record_launches` runs a kernel wrapper on CPU tensors with its ``@triton.jit`` kernels replaced by recorders
(nothing executes; outputs stay uninitialised), and :func:`compile_launch` builds one recorded launch with Triton's
real pipeline for an sm_90 target, specialised as a launch on a GPU would specialise it: the signature from the
argument types, pointer arguments and integer arguments divisible by 16 marked so (``tt.divisibility``; without it the
compiler builds a different kernel - session 31: no software pipelining, other register counts), the constexprs and
launch options (``num_warps``, ``num_stages``, ``launch_pdl``) from the launch's keywords.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int64: "i64",
           torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1", torch.int8: "i8", torch.int16: "i16"}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "num_ctas", "maxnreg")


@dataclasses.dataclass
class Launch:
    fn: object  # the JITFunction
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, fn, seen: list):
        self.fn, self.seen = fn, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(Launch(self.fn, args, kwargs))
        return launch


def record_launches(monkeypatch, targets, call):
    """``call()`` with each ``@triton.jit`` kernel ``module.<name>`` of ``targets`` (``(module, name)`` pairs)
    recording its launches instead of running: the launches in order."""
    seen: list[Launch] = []
    for module, name in targets:
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, _Recorder(fn.fn if isinstance(fn, _Recorder) else fn, seen))
    call()
    return seen


def _type(x):
    if isinstance(x, torch.Tensor):
        return "*" + _DTYPES[x.dtype], True
    if isinstance(x, bool):
        return "i1", False
    if isinstance(x, int):
        return ("i64" if abs(x) >= 2**31 else "i32"), x % 16 == 0 and x != 0
    if isinstance(x, float):
        return "fp32", False
    raise TypeError(f"no Triton type for {type(x).__name__}")


def compile_launch(launch: Launch, capability: int = 90):
    """The compiled kernel (``.asm["ptx"]``, ``["cubin"]``, ``["ttgir"]``) of a recorded launch for ``sm_<capability>``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = launch.fn
    params = list(inspect.signature(fn.fn).parameters.values())
    names = [p.name for p in params]
    consts = {k: v for k, v in launch.kwargs.items() if k not in _OPTIONS}
    for p in params[len(launch.args):]:  # constexprs left at their defaults
        if p.name not in consts and p.default is not inspect.Parameter.empty:
            consts[p.name] = p.default
    sig, attrs = {}, {}
    aligned = [["tt.divisibility", 16]]
    for i, (name, x) in enumerate(zip(names, launch.args)):
        if isinstance(x, tuple):
            types = [_type(v) for v in x]
            sig[name] = tuple(t for t, _ in types)
            attrs.update({(i, j): aligned for j, (_, div) in enumerate(types) if div})
        else:
            sig[name], div = _type(x)
            if div:
                attrs[(i,)] = aligned
    sig.update({k: "constexpr" for k in consts})
    order = [n for n in names if n in sig]
    src = ASTSource(fn=fn, signature={n: sig[n] for n in order}, attrs=attrs,
                    constexprs={(order.index(k),): v for k, v in consts.items()})
    options = {k: v for k, v in launch.kwargs.items() if k in _OPTIONS}
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)
