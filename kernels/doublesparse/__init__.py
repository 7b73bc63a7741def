"""DoubleSparse read-time ops: label scores + top-k selection, gather attention over selected tokens.

Each op dispatches to its Triton kernel for CUDA tensors when Triton is installed and the kernel's
capability check (``triton_kernel.supports_*``) accepts the call; everything else goes to the
PyTorch reference (same signature, :mod:`.reference`).  ``KVCOMPRESS_KERNELS=reference`` forces
the reference everywhere; ``KVCOMPRESS_KERNELS=triton`` also runs the kernels on CPU tensors
(under ``TRITON_INTERPRET=1``).  With ``impl=`` (chosen once by :func:`kvcompress.kernels.ops.choose`) each op
runs its registered op (``kvcompress::select_topk``, ``kvcompress::gather_partial``) with that implementation
instead (graph-capturable; nothing is decided per call).
"""

from __future__ import annotations

from . import reference
from .reference import LABEL_BITS, Labels, dequantize_labels, quantize_labels, selection_mask


def _use_triton(t) -> bool:
    from kvcompress.kernels.ops import kernels_mode, triton_available

    mode = kernels_mode()
    if mode == "reference" or not (t.is_cuda or mode == "triton"):
        return False
    return triton_available()


def select_topk(query, labels: Labels, channels, valid, k: int, *, impl: str | None = None, group: int = 1):
    """Top-``k`` token indices per query head (or per ``group`` consecutive query heads scored together) from label
    scores; see :func:`.reference.select_topk`.

    ``impl``: ``"reference"`` / ``"triton"`` through the registered op (``None``: decided per call)."""
    if impl is not None:
        from kvcompress.kernels import ops

        return ops.select(query, labels, channels, valid, k, impl=impl, group=group)
    if _use_triton(query):
        from . import triton_kernel

        if triton_kernel.supports_scores(query, labels, channels, group):
            return triton_kernel.select_topk(query, labels, channels, valid, k, group=group)
    return reference.select_topk(query, labels, channels, valid, k, group)


def gather_partial_attention(query, k, v, valid, index, scale, *, impl: str | None = None, softcap=None):
    """Attention over each row's selected tokens; see :func:`.reference.gather_partial_attention`.

    ``impl``: ``"reference"`` / ``"triton"`` through the registered op (``None``: decided per call); there
    ``index`` may also be ``[B, Hkv, 1, K]``, one selection shared by the kv head's rows.  ``softcap``: logit
    soft-cap of the scores (every implementation applies it)."""
    if impl is not None:
        from kvcompress.kernels import ops

        return ops.gather_attention(query, k, v, valid, index, scale, impl=impl, softcap=softcap)
    if _use_triton(query):
        from . import triton_kernel

        if triton_kernel.supports_gather(query, k, v, index):
            return triton_kernel.gather_partial_attention(query, k, v, valid, index, scale, softcap=softcap)
    return reference.gather_partial_attention(query, k, v, valid, index, scale, softcap=softcap)


def select_gather_attention(selection, k, v, valid, scale, *, softcap=None):
    """A :class:`~kvcompress.state.LabelTopK` selection and the attention of its decode query over the chosen
    tokens of ``k`` / ``v`` ``[B, Hkv, T, D / Dv]`` in one launch: ``(out [B, Hkv, G, Dv], lse [B, Hkv, G])``
    float32, as :func:`gather_partial_attention` gives for the selection's indices, which are recorded in
    ``selection`` (:meth:`~kvcompress.state.LabelTopK.record`).  ``None`` where the one-kernel read is not taken;
    the caller then resolves the selection and gathers.

    A static cache decided at build (``selection.one_kernel``: :func:`kvcompress.kernels.ops.choose` of
    ``"select_gather"``) and runs the registered op ``kvcompress::select_gather`` with the Triton kernel; a dynamic
    one (``one_kernel`` ``None``) takes the kernel per call where the Triton kernels run and
    :func:`.triton_kernel.fuses_gather` says so.  Either way ``fuse_gather`` in ``KVCOMPRESS_DS_CONFIG`` forces it on
    or off, and unset the measured rule decides (:func:`.triton_kernel.fuse_rule`: up to two programs per SM; over 4096
    label slots or fewer, selections of up to 256 tokens, or 512 over enough programs; over more, head dim 128+ and a
    wave of programs).  ``valid``: the middle segment's validity; the labels' must say the same (both ``None`` or
    both given)."""
    if selection.one_kernel is False or (valid is None) != (selection.valid is None):
        return None
    group = selection.group or 1
    if selection.one_kernel:
        from kvcompress.kernels import ops

        out, lse, index = ops.select_gather_attention(selection.query, selection.labels, selection.channels, valid,
                                                      k, v, selection.k, scale, impl="triton", group=group,
                                                      softcap=softcap)
    else:
        if not _use_triton(selection.query):
            return None
        from . import triton_kernel

        if not triton_kernel.fuses_gather(selection.query, selection.labels, selection.channels, k, v, selection.k,
                                          group):
            return None
        out, lse, index = triton_kernel.select_gather_partial(selection.query, selection.labels, selection.channels,
                                                              valid, k, v, selection.k, scale, group=group,
                                                              softcap=softcap)
    selection.record(index)
    return out, lse


__all__ = ["LABEL_BITS", "Labels", "dequantize_labels", "gather_partial_attention", "quantize_labels",
           "select_gather_attention", "select_topk", "selection_mask"]
