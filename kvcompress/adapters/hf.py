"""Every touchpoint between kvcompress and Hugging Face transformers.

Nothing else in kvcompress imports transformers.  This module provides:

* the base classes a kvcompress cache builds on (``CacheBase``, ``CacheLayerMixin``)
  and transformers' own layers for layer types kvcompress does not compress
  (sliding-window, chunked, linear-attention layers of hybrid models);
* the registered attention implementation ``"kvcompress"`` and its mask
  function (registered under a unique name, which is additive: no existing
  implementation is replaced);
* :func:`attach`, the reversible switch of one model to that implementation and to planned compiled decode
  steps in ``generate`` (:class:`PlannedCall`);
* model capability checks (latent/MLA caches are refused with a clear error);
* the cache keyword of ``generate``/``forward`` across transformers 5.17 - 5.x;
* loading of models and tokenizers (:func:`load_pretrained`).

Works with transformers 5.17 (``past_key_values=``) through 5.24 (``cache=``).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import weakref
from typing import Any, Iterator

import torch
from transformers import cache_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..errors import UnsupportedModelError, UnsupportedOperationError
from ..graphs import GraphStep

CacheBase = cache_utils.Cache
CacheLayerMixin = cache_utils.CacheLayerMixin

#: Name of kvcompress' attention implementation in transformers' registries.
ATTN_NAME = "kvcompress"

#: Layer types kvcompress compresses; every other type keeps transformers' own layer.
COMPRESSED_LAYER_TYPES = ("full_attention",)

#: Model types whose cache holds latents or split keys rather than plain K/V.
LATENT_CACHE_MODEL_TYPES = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_linear", "glm_moe_dsa", "minicpm3", "mistral4",
    "longcat_flash",
})


# ----------------------------------------------------------------------------- model facts


def text_config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config(decoder=True)


def check_model_supported(model: Any) -> None:
    """Refuse models whose cache does not hold post-RoPE keys and values."""
    config = text_config(model)
    model_type = getattr(config, "model_type", "")
    if model_type in LATENT_CACHE_MODEL_TYPES or getattr(config, "kv_lora_rank", None):
        raise UnsupportedModelError(
            f"model type {model_type!r} caches latent/split keys (MLA), not plain K and V; "
            "kvcompress cannot compress it. Supported: models whose attention calls cache.update(K, V) "
            "with post-RoPE keys (llama, mistral, qwen2/3, gemma, phi3, ...)"
        )
    if not getattr(model, "_can_set_attn_implementation", lambda: True)():
        raise UnsupportedModelError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface; "
            "kvcompress cannot read a compressed cache in it"
        )
    variants = model_variants(model)
    if variants:
        module = next((m for m in model.modules() if hasattr(m, "layer_idx")), None)
        if module is not None and model_eager_attention(module) is None:
            raise UnsupportedModelError(
                f"model type {model_type!r} uses {' and '.join(variants)}, which kvcompress reads through the "
                "model's own eager attention for its dense reads, and its modeling module has none")


def model_variants(model: Any) -> list[str]:
    """The attention variants a model's attention applies (what kvcompress attention reads from each call):
    ``"logit soft-capping"`` (``attn_logit_softcapping`` set, Gemma 2) and ``"learned attention sinks"`` (attention
    modules with a ``sinks`` parameter, gpt-oss)."""
    out = []
    if getattr(text_config(model), "attn_logit_softcapping", None):
        out.append("logit soft-capping")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        out.append("learned attention sinks")
    return out


def layer_layout(config: Any) -> list[tuple[str, dict]]:
    """(layer type, kwargs for transformers' own layer class) for every decoder layer."""
    types, kwargs = cache_utils.get_layer_types_and_kwargs(config)
    if isinstance(kwargs, dict):  # transformers 5.17 returns one dict shared by all layers
        kwargs = [dict(kwargs) for _ in types]
    return list(zip(types, kwargs))


def native_layer(layer_type: str, kwargs: dict, max_cache_len: int | None = None) -> Any:
    """transformers' own layer for a layer type kvcompress leaves alone (its static class when the
    cache has a capacity)."""
    if max_cache_len is None:
        mapping = cache_utils.DYNAMIC_LAYER_TYPE_MAPPING
    else:
        mapping = cache_utils.STATIC_LAYER_TYPE_MAPPING
        kwargs = dict(kwargs, max_cache_len=max_cache_len)
    if layer_type not in mapping:
        raise UnsupportedModelError(f"unknown cache layer type {layer_type!r} (known: {sorted(mapping)})")
    return mapping[layer_type](**kwargs)


def rope_inv_freq(model: Any, layer_type: str = "full_attention") -> torch.Tensor | None:
    """The inverse frequencies ``[rotary_dim / 2]`` (float32, CPU) of the model's rotary embedding for layers of
    ``layer_type`` (transformers' ``rotary_emb`` module: ``<type>_inv_freq`` on hybrids, else ``inv_freq``), or
    ``None`` when the model has no such module (learned positions)."""
    rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    if rotary is None:
        return None
    freq = getattr(rotary, f"{layer_type}_inv_freq", None)
    if not isinstance(freq, torch.Tensor):
        freq = getattr(rotary, "inv_freq", None)
    return freq.detach().float().cpu().clone() if isinstance(freq, torch.Tensor) else None


def model_dtype_device(model: Any) -> tuple[torch.dtype, torch.device]:
    """Dtype and device of the model's parameters (where a cache built ahead of time allocates)."""
    param = next(model.parameters())
    return param.dtype, param.device


#: Projections whose column-wise split under a tensor-parallel plan splits the KV heads (fused or not).
_KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv")


def head_shard(model: Any) -> Any:
    """The :class:`kvcompress.distributed.HeadShard` of a model split by transformers' tensor parallelism
    (``from_pretrained(..., tp_plan=...)`` / ``distributed_config=...`` under ``torchrun``), or ``None`` when its
    KV heads are not split (no tensor parallelism, or a plan that keeps every head on every rank).  Read once, when
    a cache is built."""
    size = getattr(model, "_tp_size", None) or 1
    if size <= 1:
        return None
    from ..distributed import HeadShard

    q_heads, kv_heads, head_dim = head_counts(text_config(model))
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    split = any(key.rsplit(".", 1)[-1] in _KEY_PROJECTIONS and "colwise" in str(style) and "gather" not in str(style)
                for key, style in plan.items())
    if not split:
        return None
    if kv_heads % size or q_heads % size:
        raise UnsupportedModelError(
            f"the model is split over {size} tensor-parallel ranks but has {kv_heads} KV heads and {q_heads} query "
            "heads; kvcompress needs both divisible by the number of ranks (each rank holds whole heads)")
    mesh = getattr(model, "_device_mesh", None) or getattr(model, "device_mesh", None)
    if mesh is None:
        raise UnsupportedModelError(f"the model reports {size} tensor-parallel ranks but no device mesh; kvcompress "
                                    "cannot tell which KV heads this process holds")
    names = getattr(mesh, "mesh_dim_names", None) or ()
    tp_mesh = mesh["tp"] if "tp" in names else mesh
    shard = HeadShard(rank=tp_mesh.get_local_rank(), size=tp_mesh.size(), kv_heads=kv_heads, q_heads=q_heads,
                      group=tp_mesh.get_group())
    # the heads a rank holds come from the column split of the key projection: check it on the first layer
    for module in model.modules():
        weight = getattr(getattr(module, "k_proj", None), "weight", None)
        if weight is None or not hasattr(weight, "to_local"):
            continue
        rows, total = weight.to_local().shape[0], weight.shape[0]
        if (rows, total) != (shard.local_kv_heads * head_dim, kv_heads * head_dim):
            raise UnsupportedModelError(
                f"the key projection of this rank holds {rows} of {total} output rows; kvcompress expects "
                f"{shard.local_kv_heads * head_dim} of {kv_heads * head_dim} ({shard.describe()})")
        break
    return shard


def layer_devices(model: Any) -> dict[int, torch.device]:
    """The device each attention layer runs on, by layer index (a model placed over several devices with
    ``device_map``): the execution device of accelerate's hook on the layer or a module above it (a layer whose
    weights are offloaded to the CPU or disk runs there), else the device of its weights.  What a cache allocated
    ahead of time allocates each layer on; a dynamic cache allocates where the layer's keys arrive."""
    modules = dict(model.named_modules())
    out: dict[int, torch.device] = {}
    for name, module in modules.items():
        index = getattr(module, "layer_idx", None)
        if not isinstance(index, int) or index in out:
            continue
        parts = name.split(".")
        for i in range(len(parts), -1, -1):
            hook = getattr(modules.get(".".join(parts[:i])), "_hf_hook", None)
            device = getattr(hook, "execution_device", None)
            if device is not None:
                out[index] = torch.device(device)
                break
        else:
            param = next(module.parameters(), None)
            if param is not None:
                out[index] = param.device
    return out


# ----------------------------------------------------------------------------- cache layers

_ACTIVE = threading.local()  # the core layer whose update() just ran, waiting for its attention


class CompressedCacheLayer(CacheLayerMixin):
    """transformers' cache layer for one compressed layer: a thin shell over the core state
    (:class:`kvcompress.layer.CompressedLayer`, or :class:`kvcompress.static.StaticLayer` for a cache
    with a capacity) that owns the hand-off from ``update`` to kvcompress' attention."""

    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, core: Any, config: Any):
        super().__init__()
        self.core = core
        self._config = config  # the model's config: which attention implementation reads this step
        self.is_compileable = bool(getattr(core, "static", False))  # a static core has a capturable step

    @property
    def is_initialized(self) -> bool:
        return self.core.is_initialized

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:  # CacheLayerMixin.__init__ sets it
        pass

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # the core allocates on its first update

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        compressed = uses_kvcompress_attention(self._config)
        if compressed:
            _check_previous_read(self.core)
        keys, values = self.core.update(key_states, value_states, compressed)
        if compressed:
            _ACTIVE.layer = self.core
        return keys, values

    def get_seq_length(self):
        return self.core.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.core.get_mask_sizes(query_length, uses_kvcompress_attention(self._config))

    def get_max_length(self) -> int:
        return self.core.get_max_length()

    @property
    def batch_size(self) -> int:
        return self.core.batch_size

    def reset(self) -> None:
        self.core.reset()

    def offload(self):  # storage is not plain keys/values; offloading is not supported
        return None

    def prefetch(self):
        return None

    def crop(self, tokens_to_remove: int) -> None:
        self.core.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.core.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        # a static cache gets new buffers of the new row count (kvcompress.static.remap_rows): call it between the
        # prefill and the first compiled step, or the compiled step records again
        self.core.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.core.map_batch(lambda t: t[indices.to(t.device)])


def claim_pending(layer_idx: int, key: torch.Tensor) -> Any:
    """The core layer whose ``update`` just ran for ``layer_idx`` (consumed once), or ``None``.

    ``key`` must be the very tensor ``update`` returned: a model that transforms keys between
    ``cache.update`` and attention cannot be read compressed.
    """
    layer = getattr(_ACTIVE, "layer", None)
    if layer is None or layer.info.index != layer_idx or layer.pending is None:
        return None
    _ACTIVE.layer = None
    if layer.pending[0] is not key:
        layer.pending = None
        raise UnsupportedModelError(
            "the model changes the keys between cache.update() and attention; kvcompress cannot read its "
            "compressed cache (use transformers' own cache for this model)")
    return layer


def _check_previous_read(core: Any) -> None:
    """Refuse to go on when the previous layer of this cache handed its keys to an attention that never read
    them: the model calling the cache does not use kvcompress attention (a second model, or a model outside
    the ``compress()`` scope of this cache's model).  The cache is marked unusable (those keys are lost)."""
    waiting = getattr(_ACTIVE, "layer", None)
    if waiting is None or waiting.pending is None:
        return
    _ACTIVE.layer = None
    waiting.pending = None
    if waiting.pipeline is not core.pipeline:
        return  # left over from another cache's interrupted forward: nothing to say about this one
    error = UnsupportedOperationError(
        f"layer {waiting.info.index} of this kvcompress cache was never read by kvcompress attention: the model "
        "calling the cache is not the one it was built for (or runs outside its `kvcompress.compress(model, stack)` "
        "scope); a cache serves one model")
    core.pipeline.failed = error
    raise error


def clear_pending() -> None:
    """Forget any unconsumed pending layer (called when a compress() scope ends)."""
    _ACTIVE.layer = None


def head_counts(config: Any) -> tuple[int, int, int]:
    """(query heads, kv heads, head_dim)."""
    q_heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // q_heads
    return q_heads, kv_heads, head_dim


# ----------------------------------------------------------------------------- attention


def _dense_attention(module: Any, **extra: Any):
    def run(query, key, value, mask, scaling, heads=None):  # heads: which query heads ``query`` holds (unused here)
        out, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **extra)
        return out

    return run


# Attention variants: what some families' eager attention computes beyond softmax(q k^T * scaling) v, and the
# attention-interface keyword that carries each (Gemma 2: `softcap`; gpt-oss: `s_aux`, its `module.sinks`).
SOFTCAP_KWARGS = ("softcap",)
SINK_KWARGS = ("s_aux", "sinks")


def attention_variant(kwargs: dict) -> tuple[float | None, torch.Tensor | None]:
    """``(softcap, sink_logits)`` of one attention call, from the keywords transformers passes: the logit soft-cap
    (``softcap * tanh(s / softcap)`` on the scaled scores, before masking; ``None`` when absent or 0) and the
    learned per-query-head sink logits ``[q_heads]`` (one extra logit in each softmax denominator, no value)."""
    softcap = next((kwargs[k] for k in SOFTCAP_KWARGS if kwargs.get(k) is not None), None)
    sinks = next((kwargs[k] for k in SINK_KWARGS if kwargs.get(k) is not None), None)
    return (float(softcap) if softcap else None), sinks


def model_eager_attention(module: Any) -> Any:
    """The ``eager_attention_forward`` of the modeling module that defines ``module``'s class (what transformers'
    ``"eager"`` implementation runs for that model), or ``None``."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return fn if callable(fn) else None


def _additive_mask(mask: torch.Tensor | None, query: torch.Tensor, kv_len: int) -> torch.Tensor | None:
    """A boolean mask (True = visible; ``None``: causal, aligned to the last keys, or nothing for one query) as the
    additive float mask transformers' eager attention takes (``0`` / the dtype's minimum, as its ``eager_mask``)."""
    q_len = query.shape[2]
    if mask is None:
        if q_len == 1:
            return None
        pos = torch.arange(kv_len, device=query.device)
        mask = (pos[None, :] <= pos[kv_len - q_len:, None])[None, None]
    if mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    return torch.where(mask, zero, torch.finfo(query.dtype).min)


def _variant_attention(module: Any, softcap: float | None, sink_logits: torch.Tensor | None, **extra: Any):
    """Dense attention with the model's variant: the model's own eager attention (which applies its soft-cap and
    learned sinks exactly as transformers does) behind kvcompress' boolean masks.  transformers' SDPA backend
    supports neither variant."""
    eager = model_eager_attention(module)
    if eager is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} uses logit soft-capping or learned attention sinks and its modeling module has "
            "no eager_attention_forward; kvcompress cannot run its dense attention")

    def run(query, key, value, mask, scaling, dropout=0.0, heads=None):  # heads: the query heads ``query`` holds
        additive = _additive_mask(mask, query, key.shape[2])
        sinks = sink_logits if sink_logits is None or heads is None else sink_logits[heads]
        out, _ = eager(module, query, key, value, additive, scaling=scaling, dropout=dropout, softcap=softcap,
                       s_aux=sinks, **extra)
        return out

    return run


def kvcompress_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface entry: read a kvcompress layer, else plain SDPA (the model's eager
    attention for a model with logit soft-capping or learned sinks, which SDPA does not support)."""
    layer = claim_pending(getattr(module, "layer_idx", -1), key)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap, sink_logits = attention_variant(kwargs)
    variant = softcap is not None or sink_logits is not None
    if layer is None:  # a layer kvcompress does not own (sliding layers, no cache, other caches)
        if variant:
            rest = {k: v for k, v in kwargs.items() if k not in SOFTCAP_KWARGS + SINK_KWARGS}
            out = _variant_attention(module, softcap, sink_logits, **rest)(query, key, value, attention_mask,
                                                                           scaling, dropout)
            return out, None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    built_for = layer.info.model_config
    if built_for is not None and getattr(module, "config", built_for) is not built_for:
        layer.pending = None
        raise UnsupportedOperationError("a kvcompress cache built for one model is read by another model's attention; "
                                        "a cache serves one model: build one per model")
    extra = {k: kwargs[k] for k in ("is_causal",) if k in kwargs}
    if variant:
        dense = _variant_attention(module, softcap, sink_logits)
    else:
        dense = _dense_attention(module, **extra)
    out = layer.attend(query, attention_mask, scaling, dense, softcap=softcap, sink_logits=sink_logits)
    return out, None


def register_attention() -> None:
    """Register ``"kvcompress"`` in both attention registries (idempotent, additive)."""
    if ATTN_NAME not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(ATTN_NAME, kvcompress_attention)
    if ATTN_NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)


def uses_kvcompress_attention(config: Any) -> bool:
    return getattr(config, "_attn_implementation", None) == ATTN_NAME


_ATTACHED: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()  # model -> [scopes, previous]
_ATTACH_LOCK = threading.Lock()


_UNSET = object()


@contextlib.contextmanager
def attach(model: Any) -> Iterator[None]:
    """Switch ``model`` to kvcompress attention, and its ``get_compiled_call`` (what ``generate`` decodes with on a
    compileable cache) to one whose single-token steps are planned by the cache (:class:`PlannedCall`); restore
    both when the last scope over it exits.  Scopes may overlap, in one thread or several: the first switches, the
    last restores.  Only this model object is touched (two attributes), nothing global."""
    register_attention()
    with _ATTACH_LOCK:
        entry = _ATTACHED.get(model)
        if entry is None:
            previous = model.config._attn_implementation
            model.set_attn_implementation(ATTN_NAME)
            shadowed = vars(model).get("get_compiled_call", _UNSET)  # an instance attribute someone set, if any
            original = getattr(model, "get_compiled_call", None)
            if callable(original):
                model.get_compiled_call = _planned_compiled_call(model, original)
            entry = _ATTACHED[model] = [0, previous, shadowed, callable(original)]
        entry[0] += 1
    try:
        yield
    finally:
        clear_pending()
        with _ATTACH_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del _ATTACHED[model]
                model.set_attn_implementation(entry[1])
                if entry[3]:
                    if entry[2] is _UNSET:
                        del model.get_compiled_call
                    else:
                        model.get_compiled_call = entry[2]


def _planned_compiled_call(model: Any, original: Any) -> Any:
    forward = CompiledForward(model)  # one per attach scope: compiled once, shared by every generate in the scope

    def get_compiled_call(compile_config: Any = None) -> "PlannedCall":
        call = original(compile_config)
        # transformers' default (no compile_config given: Inductor with mode="reduce-overhead") on one CUDA device:
        # the single-token steps replay kvcompress' own CUDA graphs; a compile_config given is used as given
        return PlannedCall(call, forward if compile_config is None and _one_cuda_device(model) else None,
                           eager=model.__call__)

    get_compiled_call.__doc__ = (f"transformers' ``get_compiled_call`` with each single-token decode step planned "
                                 f"by a kvcompress cache (:class:`{__name__}.PlannedCall`)")
    return get_compiled_call


def _one_cuda_device(model: Any) -> bool:
    """Whether ``model`` runs on one CUDA device in one process (no device map over several devices, no tensor
    parallelism): where a step captured as one CUDA graph is what serving engines do."""
    if getattr(getattr(model, "device", None), "type", None) != "cuda":
        return False
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict) and len(set(map(str, device_map.values()))) > 1:
        return False
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return not (distributed and torch.distributed.get_world_size() > 1)


class CompiledForward:
    """``torch.compile(model.__call__, fullgraph=True)`` (Inductor, no CUDA-graph trees), built at the first call:
    the function :class:`kvcompress.GraphStep` captures for ``generate`` inside :func:`attach`.  :attr:`calls`
    counts the calls that ran it (a replayed graph does not)."""

    def __init__(self, model: Any, compile_options: dict | None = None):
        self._model = weakref.ref(model)
        self.compile_options = dict(compile_options or {"fullgraph": True})
        self._fn: Any = None
        self.calls = 0

    def __call__(self, **kwargs: Any) -> Any:
        if self._fn is None:
            model = self._model()
            if model is None:
                raise UnsupportedOperationError("the model of this compiled generate step was deleted")
            self._fn = torch.compile(model.__call__, **self.compile_options)
        self.calls += 1
        return self._fn(**kwargs)


class PlannedCall:
    """transformers' compiled forward (``model.get_compiled_call(config)``, which ``generate`` decodes with on a
    compileable cache; one per ``generate`` call) with every single-token step planned by the kvcompress cache it
    is given, as :class:`kvcompress.GraphStep` plans its steps: ``cache.plan_step()`` before the call,
    ``cache.finish_step()`` after.  The compiled forward branches on the plan (one compiled variant per plan key),
    so the steps that flush nothing run no flush kernels, and the cache's host counts stay exact without reading
    the device.

    With ``graph_fn`` (a :class:`CompiledForward`: ``generate`` without a ``compile_config``, on one CUDA device)
    those steps run as replays of a :class:`kvcompress.GraphStep` over it instead of through ``call``: one captured
    graph per plan key, no per-step guard evaluation or graph-tree walk.  The GraphStep lives as long as this call
    object (one ``generate``: the cache's buffers were sized by its prefill, before the first step) and is replaced
    when a step's arguments no longer fit the captured ones (another cache, batch size or keyword set).

    Calls of several tokens on a static kvcompress cache (``generate(prefill_chunk_size=N)``, which sends its prompt
    chunks through the compiled call) run ``eager`` (the model's uncompiled ``__call__``): such a cache compiles
    single-token steps only, and its prompt chunks run eagerly.  Other caches, calls without one token count, and
    steps the caller already planned go straight to ``call``."""

    def __init__(self, call: Any, graph_fn: "CompiledForward | None" = None, eager: Any = None):
        self.call = call
        self.graph_fn = graph_fn
        self.eager = eager
        #: what the single-token steps run through, planned and finished by it: a GraphStep over ``graph_fn``
        #: (built at the first step, replaced when the arguments change), or ``call`` itself (``enabled=False``)
        self.graph_step: GraphStep | None = None if graph_fn is not None else GraphStep(call, enabled=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        tokens = kwargs.get("input_ids")
        if tokens is None:  # (generate passes input_ids=None with prompt embeddings)
            tokens = kwargs.get("inputs_embeds")
        if (args or not isinstance(tokens, torch.Tensor) or tokens.dim() < 2
                or not callable(getattr(cache, "plan_step", None)) or not getattr(cache, "is_static", False)
                or cache.step_planned):
            return self.call(*args, **kwargs)
        if tokens.shape[1] != 1:
            return (self.eager or self.call)(**kwargs)
        if self.graph_fn is not None and (self.graph_step is None or not self.graph_step.accepts(**kwargs)):
            # two direct calls before the capture, as the CLI's and the benchmarks' GraphSteps
            self.graph_step = GraphStep(self.graph_fn, warmup=2)
        return self.graph_step(**kwargs)  # the GraphStep plans the step and finishes it (completed or raised)


# ----------------------------------------------------------------------------- generate / forward


def cache_kwarg(model: Any) -> str:
    """``"cache"`` on transformers >= 5.24-style signatures, ``"past_key_values"`` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(outputs: Any) -> Any:
    return getattr(outputs, "cache", None) or getattr(outputs, "past_key_values", None)


def select_native_rows(cache: Any, index: torch.Tensor) -> None:
    """Rows ``index`` of transformers' own StaticCache, as new buffers (the benchmark's ``--fill-rows``: prefill a
    few rows, serve many).  Its layers have no ``batch_repeat_interleave``; keys and values are all a decode step
    reads, and its step counter is shared by the rows."""
    for layer in cache.layers:
        if not isinstance(getattr(layer, "keys", None), torch.Tensor) or not getattr(layer, "is_initialized", False):
            raise UnsupportedOperationError(f"cannot select the rows of a {type(layer).__name__} (a prefilled "
                                            "StaticCache layer with keys/values buffers was expected)")
        for name in ("keys", "values"):
            t = getattr(layer, name).index_select(0, index.to(layer.keys.device))
            torch._dynamo.mark_static_address(t)
            setattr(layer, name, t)
        if hasattr(layer, "batch_size"):
            layer.batch_size = len(index)


# ----------------------------------------------------------------------------- loading


def load_pretrained(path: str, *, gguf_file: str | None = None, dtype: torch.dtype = torch.float32,
                    device_map: Any = None, tp_plan: str | None = None):
    """(model, tokenizer) from a local folder or hub id, optionally from a GGUF file; ``device_map`` places layers
    over devices, ``tp_plan="auto"`` (under torchrun) splits the model over the launched ranks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(path, **kw)
    placement = {"device_map": device_map} if device_map is not None else {}
    if tp_plan is not None:
        placement["tp_plan"] = tp_plan
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **placement, **kw)
    model.eval()
    return model, tokenizer


def random_llama(config_fields: dict, name: str, device: Any, dtype: torch.dtype, seed: int = 0) -> Any:
    """A ``LlamaForCausalLM`` with random weights (transformers' own initialisation) built directly on ``device``
    from config fields: real shapes, no download (benchmarks)."""
    import transformers

    config = transformers.LlamaConfig(**config_fields)
    config._name_or_path = name
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    return model


def compile_config(options: dict, all_devices: bool = True) -> Any:
    """transformers' ``CompileConfig`` (what ``generate(compile_config=...)`` takes) from ``torch.compile`` options."""
    from transformers import CompileConfig

    config = CompileConfig(**({"mode": None} if "backend" in options else {}), **options)
    config._compile_all_devices = all_devices
    return config


def step_generate(model: Any, input_ids: torch.Tensor, cache: Any, step: Any, max_new_tokens: int,
                  do_sample: bool = False, generator: torch.Generator | None = None,
                  pad_token_id: int | None = None) -> torch.Tensor:
    """Greedy or sampled decoding of one unpadded batch through ``step`` (a decode-step callable taking
    transformers' forward keywords, e.g. :class:`kvcompress.GraphStep`), the prefill run by the eager model.

    What ``model.generate`` does for these inputs, with every single-token step going through ``step`` with
    arguments of fixed shapes (a CUDA graph replays them): explicit ``position_ids`` (and ``cache_position`` on
    transformers that take it), no growing attention mask, ``logits_to_keep=1``.  Sampling applies the model's
    generation config (temperature, top-k, top-p) with transformers' own logits warpers; decoding stops at the
    config's end-of-sequence tokens (every row finished; a finished row continues with ``pad_token_id``, as
    generate does) or after ``max_new_tokens``.  Returns ``[batch, prompt + new]`` token ids.
    """
    from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    config = model.generation_config
    warpers = []
    if do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            warpers.append(TopKLogitsWarper(config.top_k))
        if config.top_p is not None and config.top_p < 1.0:
            warpers.append(TopPLogitsWarper(config.top_p))
    eos = config.eos_token_id
    eos = torch.tensor([] if eos is None else ([eos] if isinstance(eos, int) else list(eos)), device=input_ids.device)
    kw = cache_kwarg(model)
    params = inspect.signature(model.forward).parameters
    extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    takes_cache_position = "cache_position" in params
    batch, n = input_ids.shape
    ids = input_ids

    def positions(start: int, length: int) -> dict[str, torch.Tensor]:
        pos = torch.arange(start, start + length, device=input_ids.device)
        out = {"position_ids": pos.unsqueeze(0).expand(batch, length).contiguous()}
        if takes_cache_position:
            out["cache_position"] = pos
        return out

    def choose(logits: torch.Tensor) -> torch.Tensor:
        logits = logits[:, -1].float()
        if not do_sample:
            return logits.argmax(-1)
        for warp in warpers:
            logits = warp(ids, logits)
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)

    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    out = model(input_ids=input_ids, **{kw: cache}, **positions(0, n), **extra)
    for i in range(max_new_tokens):
        tok = choose(out.logits)
        if pad_token_id is not None:
            tok = torch.where(done, torch.full_like(tok, pad_token_id), tok)
        ids = torch.cat([ids, tok.unsqueeze(1)], 1)
        done |= torch.isin(tok, eos)
        if i + 1 == max_new_tokens or bool(done.all()):
            break
        out = step(input_ids=tok.unsqueeze(1), **{kw: cache}, **positions(n + i, 1), **extra)
    return ids


def save_dequantized(model: Any, tokenizer: Any, out_dir: str) -> None:
    """Save a model loaded from GGUF as plain safetensors (transformers refuses GGUF re-serialization)."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


# ----------------------------------------------------------------------------- other named attention functions


@contextlib.contextmanager
def use_attention(model: Any, name: str, fn: Any) -> Iterator[None]:
    """Run ``model`` with the attention function ``fn``, registered under ``name``; restore on exit.

    ``name`` must start with ``"kvcompress"`` (a unique, additive registration: transformers' own
    implementations are never replaced).  ``fn`` has transformers' attention signature
    ``fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)`` and
    returns ``(output [batch, q_len, heads, head_dim], weights or None)``.  The name gets
    transformers' SDPA mask builder.  Used by LeanK calibration (kvcompress.calibration).
    """
    if not name.startswith(ATTN_NAME) or name == ATTN_NAME:
        raise ValueError(f"attention name {name!r}: use a unique name starting with {ATTN_NAME!r}")
    check_model_supported(model)
    ALL_ATTENTION_FUNCTIONS.register(name, fn)
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def layer_types(model_or_config: Any) -> list[str]:
    """Attention type of every decoder layer (``"full_attention"``, ``"sliding_attention"``, ...)."""
    return [t for t, _ in layer_layout(text_config(model_or_config))]


def final_hidden_states(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Last hidden states (after the final norm, before the LM head) of one uncached forward."""
    out = model.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of one uncached forward over ``input_ids``."""
    return model(input_ids=input_ids, use_cache=False).logits
