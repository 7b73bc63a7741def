"""Conformance: every registered compressor - the built-ins and a third-party plugin (the ``stride`` fixture under
tests/fixtures) - on the same checks, against references that do not come from the compressor itself:

* a left-padded batch gives each row what the row gives alone (the unpadded row in its own cache): for every
  compressor when the padding is a multiple of its unit (KIVI group, LeanK / low-rank flush, page), for the
  token-wise ones whatever the padding (the block-based ones do not meet that yet: docs/results.md, "Conformance");
* ``model.generate(..., cache=cache)`` gives the tokens of a step-by-step greedy loop over the same cache;
* beam search either works (a cache reordered per beam equals a fresh cache fed the chosen beam) or is refused
  with an error that names what to do, before any token is generated;
* a compressor that promises a budget holds flat memory while decoding far past it;
* the static cache's decode step compiled (``fullgraph=True``, ``aot_eager``) equals the same step run eagerly;
* the memory report equals the bytes of the tensors the cache's layers hold (walked from the layer objects,
  each storage counted once).

A compressor registered without an entry in :data:`CONFIGS` fails :func:`test_every_compressor_is_covered`.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

import kvcompress
from kvcompress.adapters import hf
from kvcompress.errors import KVCompressError
from kvcompress.manager import get_registry
from kvcompress.registry import Registry
from kvcompress.stack import parse_stack
from graph_inputs import recording_backend, unmarked_inputs
from models import lowrank_basis_file, tiny_model

FIXTURE = Path(__file__).parent / "fixtures" / "kvcompress-stride" / "kvcompress_stride.py"

#: one small configuration per registered compressor for the tiny model, and the tokens per row and layer it
#: promises to hold at most (None: no budget)
CONFIGS = {
    "window": ({"sinks": 2, "recent": 22}, 24),
    "kivi": ({"bits": 2, "group": 16, "residual": 16}, None),
    "leank": ({"mask": "rope", "ratio": 0.5, "align": 4, "sinks": 2, "local": 8, "flush": 8}, None),
    "lowrank": ({"basis": "<basis>", "sinks": 2, "recent": 8, "flush": 8}, None),
    "paged_eviction": ({"budget": 32, "block": 8}, 32),
    "double_sparse": ({"channels": "random", "r": 8, "k": 12, "dense_layers": 0, "sinks": 2, "window": 4}, None),
    "snapkv": ({"ratio": 0.5, "window": 8, "sinks": 2, "recent": 8}, None),
    "knorm": ({"ratio": 0.5, "sinks": 2, "recent": 8}, None),
    "keydiff": ({"budget": 24, "sinks": 2, "recent": 4, "phase": "both"}, 24),
    "tova": ({"budget": 24, "sinks": 2, "recent": 4}, 24),
    "expected_attention": ({"budget": 24, "sinks": 2, "recent": 4, "window": 8, "n_future": 16, "phase": "both"}, 24),
    "stride": ({"every": 2, "recent": 8}, None),
}
PROMPT, STEPS, PAD = 29, 12, 16
#: decode steps of the bounded-memory check after the budget is reached (tests/test_bounded_decode.py runs TOVA over
#: 2000; here every budgeted compressor over 16x its budget, within CI's time)
BOUNDED_STEPS = 400


def make_registry() -> Registry:
    """The process' registry (built-ins and installed plugins) plus the ``stride`` fixture plugin."""
    reg = Registry()
    for spec in get_registry():
        reg.add(spec, spec.source)
    module_spec = importlib.util.spec_from_file_location("kvcompress_stride_fixture", FIXTURE)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    module.kvcompress_register_compressors(register=lambda spec: reg.add(spec, "kvcompress-stride (fixture)"))
    return reg


def make_basis(model, folder: Path) -> str:
    """A low-rank key basis file (rank 8) for ``model``, written in ``folder``."""
    return lowrank_basis_file(model, folder / "basis.safetensors")


@pytest.fixture(scope="module")
def registry():
    return make_registry()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=1)


@pytest.fixture(scope="module")
def basis(tmp_path_factory, model):
    return make_basis(model, tmp_path_factory.mktemp("conformance"))


def _stack(registry, name, basis):
    cfg = {k: (basis if v == "<basis>" else v) for k, v in CONFIGS[name][0].items()}
    return parse_stack({"compressors": [{name: cfg}]}, registry=registry)


def _teacher_forced(model, stack, ids, mask, steps, **cache_kw):
    """Logits of the prompt's last token and of ``steps`` teacher-forced decode steps: ``[steps + 1, batch, vocab]``."""
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    n = ids.shape[1] - steps
    out = []
    kw = hf.cache_kwarg(model)
    with kvcompress.compress(model, stack, **cache_kw) as cache, torch.no_grad():
        o = model(ids[:, :n], attention_mask=mask[:, :n], position_ids=pos[:, :n], **{kw: cache})
        out.append(o.logits[:, -1])
        for t in range(n, ids.shape[1]):
            o = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1], **{kw: cache})
            out.append(o.logits[:, -1])
    return torch.stack(out), cache


names = pytest.mark.parametrize("name", sorted(CONFIGS))


def test_every_compressor_is_covered(registry):
    assert sorted(registry.names()) == sorted(CONFIGS)


@names
def test_left_padded_batch_equals_rows_alone(registry, model, basis, name):
    """Padding of PAD = 16 tokens: a multiple of every unit in CONFIGS.  Then the memory report of the batch's
    cache against the tensors its layers hold (:func:`_tensors`)."""
    stack = _stack(registry, name, basis)
    pad = PAD
    ids = torch.randint(1, 256, (2, PROMPT + pad + STEPS), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    batch, cache = _teacher_forced(model, stack, ids, mask, STEPS)
    for row, start in ((0, pad), (1, 0)):
        alone, _ = _teacher_forced(model, stack, ids[row:row + 1, start:], mask[row:row + 1, start:], STEPS)
        assert (batch[:, row] - alone[:, 0]).abs().max().item() <= 1e-5, f"row {row}"
    # the memory report equals the bytes of the tensors the layers hold (the batch's cache, after the steps)
    held: list[int] = []
    seen: set = set()
    for core in cache.compressed_layers:
        _tensors(core, seen, held)
    assert cache.memory_report().cache_bytes == sum(held)


@names
def test_static_cache_equals_dynamic_cache(registry, model, basis, name):
    """A cache with a capacity (static: device-side counters, a ring by position) decides and computes what the
    dynamic cache does, on a batch with an unaligned left-padded row: the same blocks leave the window (sinks and
    padding never enter the static ring), so every compressor sees the same tokens.  A compressor that is not
    graph-safe gets a dynamic cache either way."""
    stack = _stack(registry, name, basis)
    ids = torch.randint(1, 256, (2, PROMPT + 5 + STEPS), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        static, _ = _teacher_forced(model, stack, ids, mask, STEPS, max_cache_len=ids.shape[1] + 2)
    dynamic, _ = _teacher_forced(model, stack, ids, mask, STEPS)
    assert (static - dynamic).abs().max().item() <= 5e-5


#: compressors that decide token by token: a left-padded row equals the row alone whatever the padding.  The
#: others form groups / pages / flush blocks over storage columns, so padding that is not a multiple of their
#: unit puts different real tokens in one unit: checked above at a padding of 16 (a multiple of every unit here);
#: at a padding of 3 they differ (docs/results.md, "Conformance").
TOKENWISE = ("window", "double_sparse", "snapkv", "knorm", "keydiff", "tova", "expected_attention")


@pytest.mark.parametrize("name", TOKENWISE)
def test_unaligned_left_padding_equals_rows_alone(registry, model, basis, name):
    stack = _stack(registry, name, basis)
    ids = torch.randint(1, 256, (2, PROMPT + 3 + STEPS), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    batch, _ = _teacher_forced(model, stack, ids, mask, STEPS)
    alone, _ = _teacher_forced(model, stack, ids[:1, 3:], mask[:1, 3:], STEPS)
    assert (batch[:, 0] - alone[:, 0]).abs().max().item() <= 1e-5


@names
def test_generate_equals_a_greedy_step_loop(registry, model, basis, name):
    """``model.generate`` (left-padded batch) gives the tokens of argmax over a step-by-step loop on a fresh cache."""
    stack = _stack(registry, name, basis)
    ids = torch.randint(1, 256, (2, PROMPT + PAD), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    kw = hf.cache_kwarg(model)
    with kvcompress.compress(model, stack) as cache, torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, pad_token_id=0,
                             **{kw: cache})[:, ids.shape[1]:]
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    tokens = []
    with kvcompress.compress(model, stack) as cache, torch.no_grad():
        o = model(ids, attention_mask=mask, position_ids=pos, **{kw: cache})
        full, p = mask, pos[:, -1:]
        for _ in range(STEPS):
            tok = o.logits[:, -1:].argmax(-1)
            tokens.append(tok)
            full, p = torch.cat([full, torch.ones_like(tok)], 1), p + 1
            o = model(tok, attention_mask=full, position_ids=p, **{kw: cache})
    assert torch.equal(out, torch.cat(tokens, 1))


@names
def test_beam_search_reorders_or_is_refused(registry, model, basis, name):
    """Beam search either works - the best beam's summed log-probability equals that of the same tokens fed to a fresh
    cache (so every reorder moved each beam's own state) - or is refused before generating, saying what to do."""
    stack = _stack(registry, name, basis)
    ids = torch.randint(1, 256, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    kw = hf.cache_kwarg(model)
    with kvcompress.compress(model, stack) as cache, torch.no_grad():
        try:
            res = model.generate(ids, max_new_tokens=STEPS, num_beams=3, do_sample=False, length_penalty=0.0,
                                 early_stopping=True, output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=0, **{kw: cache})
        except KVCompressError as exc:
            assert "beam" in str(exc).lower() and ("use" in str(exc).lower() or "instead" in str(exc).lower())
            return
    seq = res.sequences[0]
    logits, _ = _teacher_forced(model, stack, seq[None, :-1], torch.ones_like(seq[None, :-1]), STEPS - 1)
    logp = torch.log_softmax(logits[:, 0].float(), -1).gather(-1, seq[PROMPT:, None]).sum()
    assert abs(logp.item() - res.sequences_scores[0].item()) <= 1e-4


@pytest.mark.parametrize("name", sorted(n for n, (_, budget) in CONFIGS.items() if budget is not None))
def test_budget_holds_memory_flat_while_decoding(registry, model, basis, name):
    stack = _stack(registry, name, basis)
    ids = torch.randint(1, 256, (1, BOUNDED_STEPS + 64), generator=torch.Generator().manual_seed(5))
    kw = hf.cache_kwarg(model)
    with kvcompress.compress(model, stack) as cache, torch.no_grad():
        model(ids[:, :PROMPT + PAD], **{kw: cache})
        for t in range(PROMPT + PAD, 64):
            model(ids[:, t:t + 1], **{kw: cache})
        first = cache.memory_report()
        for t in range(64, ids.shape[1]):
            model(ids[:, t:t + 1], **{kw: cache})
        end = cache.memory_report()
    assert end.tokens == ids.shape[1]
    assert end.segments == first.segments
    assert end.cache_bytes < end.dense_native_bytes / 4


#: compressors whose compiled static decode step is already checked against eager, with longer runs crossing their
#: flush / eviction / selection events (CI time: each compile costs seconds)
COMPILED_ELSEWHERE = {name: "tests/test_compiled_decode.py" for name in
                      ("window", "kivi", "leank", "lowrank", "paged_eviction", "double_sparse")}
COMPILED_ELSEWHERE.update({name: "tests/test_bounded_decode.py" for name in ("tova", "expected_attention")})


@names
def test_compiled_decode_equals_eager(registry, model, basis, name):
    """The static cache's decode step under torch.compile(fullgraph=True, aot_eager): one graph, eager's logits.  A
    compressor that does not declare ``graph_safe`` gets a dynamic cache instead, with one warning naming it."""
    if name in COMPILED_ELSEWHERE:
        pytest.skip(f"compiled = eager over 100+ steps across its events in {COMPILED_ELSEWHERE[name]}")
    stack = _stack(registry, name, basis)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = kvcompress.Cache(stack, model, max_cache_len=64)
    if not probe.is_compileable:
        said = [str(w.message) for w in caught if f"'{name}'" in str(w.message)]
        assert len(said) == 1 and "graph_safe" in said[0] and "runs eagerly" in said[0]
        assert registry.get(name).source != "built-in"  # every built-in is graph-safe
        return
    ids = torch.randint(1, 256, (2, PROMPT + 6), generator=torch.Generator().manual_seed(6))  # 6 steps: compile dominates
    kw = hf.cache_kwarg(model)
    graph_inputs: list = []
    backend = recording_backend(graph_inputs)
    runs, step_inputs = [], set()
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        out = []
        with kvcompress.compress(model, stack, max_cache_len=ids.shape[1] + 2) as cache, torch.no_grad():
            step = torch.compile(model.forward, backend=backend, fullgraph=True) if compiled else model.forward
            model(ids[:, :PROMPT], **{kw: cache})
            for t in range(PROMPT, ids.shape[1]):
                pos = torch.full((2, 1), t)
                step_inputs.add(pos.untyped_storage().data_ptr())
                o = step(input_ids=ids[:, t:t + 1], position_ids=pos, **{kw: cache})
                out.append(o.logits[:, -1])
        runs.append(torch.stack(out))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == 1
    assert (runs[1] - runs[0]).abs().max().item() <= 1e-5
    # every tensor the compiled step reads, other than the step's own inputs and the model's weights, is marked as a
    # static address: under mode="reduce-overhead" an unmarked input is copied into the CUDA graphs' pool before
    # every replay (a host-side copy per layer and step)
    step_inputs.add(ids.untyped_storage().data_ptr())
    copied = unmarked_inputs(graph_inputs, model, step_inputs)
    assert not copied, f"{name}: graph inputs not marked static (copied before every replay): {copied}"


@names
def test_static_memory_report_counts_every_tensor_held(registry, model, basis, name):
    """A static cache's memory report after a left-padded prefill and decode steps equals the bytes of the tensors
    its layers hold (each storage once; :func:`_tensors`), as the dynamic cache's does above."""
    stack = _stack(registry, name, basis)
    ids = torch.randint(1, 256, (2, PROMPT + PAD + STEPS), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a plugin that is not graph-safe gets a dynamic cache: checked the same way
        _, cache = _teacher_forced(model, stack, ids, mask, STEPS, max_cache_len=ids.shape[1] + 2)
    held: list[int] = []
    seen: set = set()
    for core in cache.compressed_layers:
        _tensors(core, seen, held)
    assert cache.memory_report().cache_bytes == sum(held)


def _tensors(obj, seen, out, depth=0):
    """Every tensor reachable from ``obj`` through kvcompress objects, lists, tuples and dicts (storages once)."""
    if isinstance(obj, torch.Tensor):
        key = (obj.untyped_storage().data_ptr(), obj.device)
        if key not in seen and obj.untyped_storage().nbytes():
            seen.add(key)
            out.append(obj.untyped_storage().nbytes())
        return
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("kvcompress", "plugins"):
        # not walked: the compressors and the layer's description, and a paged store's read view (``_segments``:
        # the page validity gathered per row, rebuilt after the pages change; bytes of the order of the block
        # table), which the report leaves out
        items = [v for k, v in vars(obj).items() if k not in ("pipeline", "info", "layout", "_segments")]
    else:
        return
    for item in items:
        _tensors(item, seen, out, depth + 1)


