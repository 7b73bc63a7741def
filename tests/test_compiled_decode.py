"""Static (capacity) caches: a graph-capturable decode step for every built-in stack.

Every stack is traced with ``torch.compile(fullgraph=True, backend="aot_eager")`` (a graph break
fails), one compilation must serve >= 100 decode steps across flush / eviction / selection events,
and the compiled logits must equal the same static cache run eagerly.  The eager static path is
checked against independent references: the uncompressed model, the masked-attention oracle and
the dynamic cache (itself tested against oracles in the per-compressor tests).
"""

from __future__ import annotations

import gc
import os
import warnings
import weakref

import pytest
import torch

import kvcompress
from kvcompress.errors import ConfigError, UnsupportedOperationError
from graph_inputs import recording_backend, unmarked_inputs
from models import lowrank_basis_file, tiny_model
from reference import masked_logits, window_visibility

PROMPT, STEPS = 40, 100

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny single-token steps (tests/conftest.py)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def lowrank_basis(tmp_path_factory, model):
    return lowrank_basis_file(model, tmp_path_factory.mktemp("lowrank") / "basis.safetensors", tokens=96)


KIVI2 = {"kivi": {"bits": 2, "group": 16, "residual": 16}}
KIVI4S = {"kivi": {"bits": 4, "group": 16, "residual": 32, "sinks": 4}}
LEANK = {"leank": {"mask": "rope", "ratio": 0.5, "align": 4, "sinks": 4, "local": 24, "flush": 16}}
PAGED = {"paged_eviction": {"budget": 64, "block": 8}}
DS = {"double_sparse": {"channels": "random", "r": 8, "k": 24, "dense_layers": 0, "sinks": 2, "window": 8}}

STACKS = {
    "none": [],
    "window": [{"window": {"sinks": 2, "recent": 30}}],
    "window+kivi2": [{"window": {"sinks": 0, "recent": 64}}, KIVI2],
    "kivi2": [KIVI2],
    "kivi4+sinks": [KIVI4S],
    "leank": [LEANK],
    "leank+kivi2": [LEANK, KIVI2],
    "paged": [PAGED],
    "paged+kivi2": [{"paged_eviction": {"budget": 96, "block": 16}}, KIVI2],
    "double_sparse": [DS],
    "double_sparse-shared+kivi2": [{"double_sparse": dict(DS["double_sparse"], group_shared=True, label_bits=4)},
                                   {"kivi": {"bits": 2, "group": 16, "residual": 16}}],
    "lowrank": ["lowrank"],
    "lowrank+kivi2": ["lowrank", KIVI2],
    "snapkv+leank": [{"snapkv": {"ratio": 0.5, "window": 8, "sinks": 4, "recent": 24}}, LEANK],
}


# Stacks whose compiled step is checked.  "kivi2" alone is left out: five other stacks run its store (2-bit, group 16,
# residual 16) with the same flush schedule, without an evictor ("double_sparse-shared+kivi2": selection only) and
# with one ("window+kivi2": the same steps as "kivi2" until its window starts evicting); it stays in the eager checks.
# In CI (without KVCOMPRESS_TEST_FULL=1) "window", "leank", "lowrank" and "paged" alone are left out too (sessions 59
# and 62, 10-15 s of tracing each on the CI machine): their state, flushes and evictions run compiled in
# "window+kivi2", "leank+kivi2", "snapkv+leank", "lowrank+kivi2" and "paged+kivi2", and alone in the eager checks below.
COMPILED = [name for name in STACKS if name != "kivi2"
            and (os.environ.get("KVCOMPRESS_TEST_FULL") or name not in ("window", "leank", "lowrank", "paged"))]


def _stack(name, basis):
    entries = [{"lowrank": {"basis": basis, "sinks": 4, "recent": 24, "flush": 16}} if e == "lowrank" else e
               for e in STACKS[name]]
    return {"compressors": entries} if entries else None


def _ids(batch=2, length=PROMPT + STEPS, seed=0, pad=0):
    ids = torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if pad:
        mask[0, :pad] = 0
    return ids, mask


def _run(model, stack, ids, mask, *, static=True, compiled=False, prompt=PROMPT, record=None):
    """Prefill ``prompt`` tokens eagerly, then one decode step per remaining token; logits of every step.
    ``record`` (a dict): receives the compiled graphs' tensor inputs (``"graph"``) and the storages of the tensors
    the steps were given (``"step"``: ids, mask, positions)."""
    kw = {"max_cache_len": ids.shape[1] + 4} if static else {}
    out = []

    backend = recording_backend(record.setdefault("graph", [])) if record is not None else "aot_eager"
    with kvcompress.compress(model, stack, **kw) as cache, torch.no_grad():
        step = torch.compile(model.forward, backend=backend, fullgraph=True) if compiled else model.forward
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        if record is not None:
            record["step"] = {ids.untyped_storage().data_ptr(), pos.untyped_storage().data_ptr()}
        first = model(ids[:, :prompt], attention_mask=mask[:, :prompt], position_ids=pos[:, :prompt], cache=cache)
        out.append(first.logits[:, -1])
        for t in range(prompt, ids.shape[1]):
            # generate's way: the 2-D mask grows by one column per step (a new contiguous tensor)
            step_mask = mask[:, :t + 1].contiguous()
            if record is not None:
                record["step"].add(step_mask.untyped_storage().data_ptr())
            o = step(input_ids=ids[:, t:t + 1], attention_mask=step_mask, position_ids=pos[:, t:t + 1], cache=cache)
            out.append(o.logits[:, -1])
    return torch.stack(out).float(), cache


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_decode_equals_eager_within_two_graphs(model, lowrank_basis, name):
    stack = _stack(name, lowrank_basis)
    ids, mask = _ids(pad=3)
    eager, cache = _run(model, stack, ids, mask)
    assert cache.is_compileable
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    record: dict = {}
    compiled, ccache = _run(model, stack, ids, mask, compiled=True, record=record)
    stats = torch._dynamo.utils.counters["stats"]
    # the growing 2-D mask costs one recompilation with a dynamic length (as with transformers' StaticCache);
    # nothing else may recompile, whatever the cache does (flushes, evictions, selections)
    assert stats["unique_graphs"] <= 2, dict(stats)
    assert (compiled - eager).abs().max().item() <= 1e-5
    # every tensor a compiled step reads, other than the step's own inputs and the model's weights, is marked as a
    # static address: under mode="reduce-overhead" an unmarked input is copied into the CUDA graphs' pool before
    # every replay (a host-side copy per layer and step)
    copied = unmarked_inputs(record["graph"], model, record["step"])
    assert not copied, f"{name}: graph inputs not marked static (copied before every replay): {copied}"
    for core in ccache.compressed_layers:  # the steps crossed lifecycle events
        if core.middle is not None:
            assert int(core.flushed) >= 4 * core.flush_size, name
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["window", "kivi4+sinks"])
def test_compiled_steps_fill_sinks_a_short_prompt_left_open(model, name):
    """A prompt shorter than the sink slots (row 0 left-padded: one real token; row 1: two) leaves the sinks open, so
    the unplanned compiled steps must keep moving each row's first tokens into them, as the eager steps do (a
    prompt that fills them compiles without the scan).  Without it the window evicts those tokens later (window) or
    the flushes quantize them (KIVI-4 with sinks), and the logits part.  A compiled step of a long prompt runs first
    (the variant without the scan): the short prompt's steps must not reuse it."""
    stack = _stack(name, None)
    ids, mask = _ids(length=2 + 70, pad=1)
    eager, cache = _run(model, stack, ids, mask, prompt=2)
    torch._dynamo.reset()
    long_ids, long_mask = _ids(length=PROMPT + 3, seed=1)
    _, lcache = _run(model, stack, long_ids, long_mask, compiled=True)
    assert all(c._sinks_full for c in lcache.compressed_layers)
    compiled, ccache = _run(model, stack, ids, mask, compiled=True, prompt=2)
    assert not any(c._sinks_full for c in ccache.compressed_layers)
    assert (compiled - eager).abs().max().item() <= 1e-5
    for core, ccore in zip(cache.compressed_layers, ccache.compressed_layers):
        assert torch.equal(core.sink_count, ccore.sink_count) and int(ccore.sink_count.min()) == ccore.sink_slots
        assert torch.equal(core.sink_pos, ccore.sink_pos)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(STACKS))
def test_static_eager_equals_dynamic_cache(model, lowrank_basis, name):
    """Every stack decides and computes the same in a static cache as in a dynamic one (the reference), with a
    left-padded row: the same blocks leave the window (leading padding and sink columns never enter the static
    ring, as the dynamic cache drops them), so quantizers, pruners and projections see the same tokens."""
    stack = _stack(name, lowrank_basis)
    ids, mask = _ids(pad=3)
    static, _ = _run(model, stack, ids, mask)
    dynamic, _ = _run(model, stack, ids, mask, static=False)
    # fp32 summation order (kivi4+sinks with the padded row: up to 2.4e-5); a flush schedule that differed by the sink
    # count gave 0.18 (leank) to 0.88 (snapkv + leank)
    assert (static - dynamic).abs().max().item() <= 5e-5


def test_empty_stack_equals_uncompressed_model(model):
    ids, mask = _ids(batch=1)
    got, cache = _run(model, None, ids, mask)
    with torch.no_grad():
        ref = model(ids).logits[0, PROMPT - 1:].float()
    assert (got[:, 0] - ref).abs().max().item() <= 1e-4
    report = cache.memory_report()
    dense = 2 * 2 * 2 * (ids.shape[1] + 4) * 16 * 4  # layers x (k, v) x kv heads x capacity x head_dim x fp32
    assert report.cache_bytes <= 1.02 * dense


def test_window_matches_masked_oracle(model):
    ids, mask = _ids(batch=1)
    got, _ = _run(model, _stack("window", None), ids, mask)
    chunks = [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, ids.shape[1])]
    ref = masked_logits(model, ids, window_visibility(ids.shape[1], chunks, 2, 30))[PROMPT - 1:]
    assert (got[:, 0] - ref).abs().max().item() <= 1e-4


def test_window_memory_stays_bounded(model):
    ids, mask = _ids(batch=1, length=300)
    _, cache = _run(model, _stack("window", None), ids, mask)
    report = cache.memory_report()
    assert report.cache_bytes < report.dense_fp16_bytes * 2 * 40 / 300 * 1.5  # ~32 fp32 slots, not 300


def test_generate_with_static_cache_equals_dynamic(model):
    ids, _ = _ids(batch=1, length=30)
    outs = []
    for kw in ({}, {"max_cache_len": 80}):
        with kvcompress.compress(model, _stack("kivi2", None), **kw) as cache:
            outs.append(model.generate(ids, max_new_tokens=40, do_sample=False, cache=cache))
    assert torch.equal(outs[0], outs[1])


# CI runs the stacked case (LeanK lanes + KIVI-2 codes, chunked prompt: kivi2's store inside it); kivi2 alone with
# KVCOMPRESS_TEST_FULL=1 (6 s, cut in session 63 to keep CI under its 20 minutes)
@pytest.mark.parametrize("name", ["leank+kivi2"] + (["kivi2"] if os.environ.get("KVCOMPRESS_TEST_FULL") else []))
def test_generate_auto_compile_plans_every_step(model, name):
    """transformers' generate compiles the decode step itself for a compileable cache (its auto-compile; on CUDA with
    mode="reduce-overhead", where a graph input whose shape changes per step would re-record the CUDA graphs every
    step).  Inside ``kvcompress.compress`` every one of its single-token steps is planned by the cache, so it compiles
    one graph per plan key seen (the steps that flush a block and those that do not), with no symbolic (per-step)
    sizes among its inputs, and gives the eager generate's tokens.  Through a ``compile_config`` that allows the
    CPU.  With ``prefill_chunk_size`` (leank+kivi2), transformers sends the prompt chunks through its compiled call
    too: they run eagerly (a static kvcompress cache compiles single-token steps only), as in the eager generate."""
    from kvcompress.adapters import hf

    ids, _ = _ids(batch=1, length=30)
    chunks = {"prefill_chunk_size": 12} if name == "leank+kivi2" else {}
    with kvcompress.compress(model, _stack(name, None), max_cache_len=80) as cache:
        eager = model.generate(ids, max_new_tokens=40, do_sample=False, cache=cache, **chunks)
    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append([x for x in example_inputs if not isinstance(x, torch.Tensor)])
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    keys: list = []
    finished: list = []
    with kvcompress.compress(model, _stack(name, None), max_cache_len=80) as cache:
        plan, finish = cache.plan_step, cache.finish_step
        cache.plan_step = lambda: keys.append(plan()) or keys[-1]
        cache.finish_step = lambda completed=True: finished.append(completed) or finish(completed)
        compiled = model.generate(ids, max_new_tokens=40, do_sample=False, cache=cache, **chunks,
                                  compile_config=hf.compile_config({"backend": backend, "fullgraph": True}))
        assert not cache.step_planned
        # the host counts the plans advanced equal the device's
        assert all(core.host_counts() == (int(core.seen), int(core.flushed)) for core in cache.compressed_layers)
    assert "get_compiled_call" not in vars(model)  # the model's own method again
    assert len(keys) == 39 and finished == [True] * 39  # every step after the eager prefill's token
    flushing = [k for k in keys if k[0]]
    assert flushing and len(flushing) < len(keys), keys  # both kinds of step ran, each in its own variant
    assert len(graphs) == len(set(keys)) and all(g == [] for g in graphs), (len(graphs), set(keys))
    assert torch.equal(compiled, eager)


def test_dropped_cache_is_freed_without_gc(model):
    ids, mask = _ids(batch=1, length=60)
    gc.disable()
    try:
        for kw in ({}, {"max_cache_len": 64}):
            _, cache = _run(model, _stack("kivi2", None), ids, mask, static=bool(kw), prompt=40)
            ref = weakref.ref(cache)
            del cache
            assert ref() is None, kw
    finally:
        gc.enable()


def test_capacity_errors_are_clear(model):
    with pytest.raises(ConfigError, match="max_cache_len"):
        kvcompress.Cache(None, model, max_cache_len=0)
    with pytest.raises(ConfigError, match="max_batch_size"):
        kvcompress.Cache(None, model, max_batch_size=2)
    ids, mask = _ids(batch=1, length=20)
    with kvcompress.compress(model, None, max_cache_len=16) as cache, torch.no_grad():
        with pytest.raises(UnsupportedOperationError, match="max_cache_len=16"):
            model(ids, cache=cache)
    with kvcompress.compress(model, None, max_cache_len=20) as cache, torch.no_grad():
        model(ids, cache=cache)
        with pytest.raises(UnsupportedOperationError, match="is full"):
            model(ids[:, :1], cache=cache)
    cache = kvcompress.Cache(None, model, max_cache_len=32)
    with pytest.raises(UnsupportedOperationError, match="kvcompress.compress"), torch.no_grad():
        model(ids, cache=cache)


def test_early_allocation_with_max_batch_size(model):
    cache = kvcompress.Cache(_stack("kivi2", None), model, max_cache_len=64, max_batch_size=2)
    core = cache.compressed_layers[0]
    assert core.is_initialized and core.k.shape[0] == 2 and core.middle.ring.valid is not None
    ids, mask = _ids(batch=2, length=50)
    with kvcompress.compress(model, _stack("kivi2", None), max_cache_len=64) as fresh:
        pass
    assert fresh.compressed_layers[0].is_initialized is False


def test_not_graph_safe_plugin_runs_eagerly_with_one_warning(model, with_stride_plugin):
    stack = {"compressors": [{"stride": {"every": 2, "recent": 8}}]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = kvcompress.Cache(stack, model, max_cache_len=64)
    messages = [str(w.message) for w in caught if "graph_safe" in str(w.message)]
    assert len(messages) == 1 and "'stride'" in messages[0] and "kvcompress_evict_tokens" in messages[0]
    assert not cache.is_compileable and not cache.is_static
    ids, mask = _ids(batch=1, length=60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, _ = _run(model, stack, ids, mask)
    ref, _ = _run(model, stack, ids, mask, static=False)
    assert (got - ref).abs().max().item() == 0.0


def test_beam_search_with_static_cache_equals_dynamic(model):
    """reorder_cache permutes a static cache's rows in place (buffer addresses stay for a compiled step)."""
    ids, _ = _ids(batch=1, length=30)
    outs = []
    for kw in ({}, {"max_cache_len": 80}):
        with kvcompress.compress(model, _stack("kivi2", None), **kw) as cache:  # no sinks: same groups
            outs.append(model.generate(ids, max_new_tokens=30, num_beams=2, do_sample=False, cache=cache))
    assert torch.equal(outs[0], outs[1])


SNAP = {"snapkv": {"budget": 40, "sinks": 2, "recent": 16, "window": 8, "phase": "both"}}
EXPECTED = {"expected_attention": {"budget": 40, "sinks": 2, "recent": 16, "window": 16, "phase": "both"}}


@pytest.mark.parametrize("name", ["window+kivi2", "kivi4+sinks", "leank+kivi2", "paged+kivi2",
                                  "double_sparse-shared+kivi2", "lowrank+kivi2", "snapkv", "expected_attention"])
def test_static_rows_repeated_after_prefill_equal_a_batch_prefilled_whole(model, lowrank_basis, name):
    """batch_repeat_interleave on a static cache (one prefilled row served as three; num_return_sequences,
    benchmark fills) gives every row the state a real three-row prefill gives it: the decode logits of both caches
    agree over flushes, page evictions and selections; batch_select_indices then keeps the chosen rows."""
    extra = {"snapkv": SNAP, "expected_attention": EXPECTED}
    stack = {"compressors": [extra[name]]} if name in extra else _stack(name, lowrank_basis)
    ids, _ = _ids(batch=1, length=PROMPT)
    steps = torch.randint(1, 256, (3, 40), generator=torch.Generator().manual_seed(5))
    logits = []
    for repeat in (False, True):
        out = []
        with kvcompress.compress(model, stack, max_cache_len=PROMPT + 48) as cache, torch.no_grad():
            model(ids if repeat else ids.repeat(3, 1), cache=cache)
            if repeat:
                cache.batch_repeat_interleave(3)
            for t in range(steps.shape[1]):
                pos = torch.full((3, 1), PROMPT + t)
                out.append(model(input_ids=steps[:, t:t + 1], position_ids=pos, cache=cache).logits[:, -1])
            cache.batch_select_indices(torch.tensor([2, 0]))
            pos = torch.full((2, 1), PROMPT + steps.shape[1])
            out.append(torch.cat([model(input_ids=steps[[2, 0], :1], position_ids=pos, cache=cache).logits[:, -1],
                                  torch.zeros(1, model.config.vocab_size)]))
        logits.append(torch.stack(out))
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-5
