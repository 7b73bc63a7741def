"""kvcompress.graphs.GraphStep: a static cache's decode step replayed as one captured CUDA graph.

On the CPU a GraphStep calls its function (no graph); its wrapper logic (argument checks, output
copies) is checked here. On a CUDA device (``-m gpu``) the replayed steps are compared with the eager
static cache's logits over steps that cross flush events, and a capture of a step that reads device
values on the host must fail with a clear error.
"""

from __future__ import annotations

import pytest
import torch

import kvcompress
from kvcompress.errors import UnsupportedOperationError
from kvcompress.graphs import GraphStep, _clone
from models import tiny_model


def _decode(model, stack, steps, step_fn=None, prompt=24, device="cpu"):
    """Teacher-forced logits of ``steps`` single-token steps after an eager prefill, through ``step_fn``
    (built from the model) or the eager model."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 256, (2, prompt + steps), generator=g).to(device)
    out = []
    with kvcompress.compress(model, stack, max_cache_len=prompt + steps + 4) as cache, torch.no_grad():
        fn = step_fn(model) if step_fn is not None else model.forward
        pos = torch.arange(prompt + steps, device=device).expand(2, -1)
        model(ids[:, :prompt], position_ids=pos[:, :prompt], past_key_values=cache)
        for i in range(prompt, prompt + steps):
            o = fn(input_ids=ids[:, i:i + 1].clone(), position_ids=pos[:, i:i + 1].clone(), past_key_values=cache,
                   logits_to_keep=1)
            out.append(o.logits[:, -1].float())
    return torch.stack(out), fn


def test_cpu_step_is_a_plain_call_and_outputs_are_copies():
    calls = []

    def fn(x, k=1):
        calls.append(k)
        return {"y": x * k, "keep": "x"}

    step = GraphStep(fn, warmup=1)
    x = torch.arange(4.0)
    out = step(x=x, k=2)
    assert torch.equal(out["y"], x * 2) and calls == [2] and step.graph is None and step.replays == 0
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        GraphStep(fn, warmup=0)


def test_clone_copies_tensors_of_model_outputs():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    logits = torch.randn(2, 1, 8)
    marker = object()
    out = _clone(CausalLMOutputWithPast(logits=logits, past_key_values=marker))
    assert type(out) is CausalLMOutputWithPast and out.past_key_values is marker
    assert torch.equal(out.logits, logits) and out.logits.data_ptr() != logits.data_ptr()


PLANNED_STACKS = {
    "kivi2": [{"kivi": {"bits": 2, "group": 16, "residual": 16}}],
    "window+sinks": [{"window": {"sinks": 2, "recent": 16}}],
    "paged+kivi2": [{"paged_eviction": {"budget": 64, "block": 16}}, {"kivi": {"bits": 2, "group": 16, "residual": 16}}],
    "double_sparse-shared+kivi2": [{"double_sparse": {"channels": "random", "r": 8, "k": 24, "dense_layers": 0,
                                                      "sinks": 2, "window": 8, "group_shared": True, "label_bits": 4}},
                                   {"kivi": {"bits": 2, "group": 16, "residual": 16}}],
}


@pytest.mark.parametrize("name", list(PLANNED_STACKS))
def test_cpu_graph_step_decodes_like_the_eager_static_cache(name):
    """The planned compiled step (GraphStep off CUDA: direct calls, a plan before each) of every kind of stack - a
    quantizer, a window with sinks, an evictor + quantizer, a selector + quantizer - over 40 steps that cross several
    flushes: the logits of the eager static cache."""
    from kvcompress.evaluation.runner import graph_step

    model = tiny_model("llama")
    stack = kvcompress.parse_stack({"compressors": PLANNED_STACKS[name]})
    torch._dynamo.reset()
    eager, _ = _decode(model, stack, 40)
    replayed, fn = _decode(model, stack, 40, step_fn=lambda m: graph_step(m, warmup=2))
    assert fn.calls == 40 and fn.replays == 0  # no graph off CUDA
    torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-5)


KIVI_SMALL = {"compressors": [{"kivi": {"bits": 2, "group": 16, "residual": 16}}]}


def test_cpu_planned_steps_compile_one_variant_per_plan_and_keep_host_counts(monkeypatch):
    """Through a GraphStep the static cache plans every decode step on the host: the compiled step has one
    variant that flushes and one that does not (compiled once each; the one that does not flush is the smallest
    graph: no flush pipeline), the logits equal the unplanned compiled step's (which offers a block every step
    and lets the device decide) and the eager step's, and the plans advance the host counts step by step."""
    model = tiny_model("llama")
    stack = kvcompress.parse_stack(KIVI_SMALL)
    eager, _ = _decode(model, stack, 40)
    sizes = []

    def backend(gm, example_inputs):  # records each compiled graph's size, runs it as traced
        sizes.append(len(gm.graph.nodes))
        return gm.forward

    hosts = []
    plan_step = kvcompress.Cache.plan_step

    def spy(cache):
        key = plan_step(cache)
        hosts.append(cache.compressed_layers[0].host_counts())
        return key

    monkeypatch.setattr(kvcompress.Cache, "plan_step", spy)
    torch._dynamo.reset()
    planned, step = _decode(model, stack, 40, step_fn=lambda m: GraphStep(
        torch.compile(m.forward, backend=backend, fullgraph=True), warmup=2))
    assert len(sizes) == 2 and step.direct_calls == 40  # two variants, nothing recompiled; no graph on the CPU
    no_flush, flush = sizes
    torch.testing.assert_close(planned, eager, rtol=0, atol=1e-5)
    # the host counts after each plan: one more token seen, a block of 16 flushed when 32 are past the flushed
    assert [h[0] for h in hosts] == list(range(25, 65))
    flushed = [h[1] for h in hosts]
    assert flushed == [16 * ((n - 16) // 16) for n in range(25, 65)]
    monkeypatch.undo()
    torch._dynamo.reset()
    sizes.clear()
    unplanned, _ = _decode(model, stack, 40, step_fn=lambda m: torch.compile(m.forward, backend=backend,
                                                                                fullgraph=True))
    assert len(sizes) == 1 and no_flush < sizes[0]  # the unplanned step offers a block every step
    torch.testing.assert_close(unplanned, planned, rtol=0, atol=1e-5)


def test_planned_host_counts_equal_the_device_counters_and_misuse_is_refused():
    model = tiny_model("llama")
    stack = kvcompress.parse_stack(KIVI_SMALL)
    ids = torch.randint(1, 256, (2, 60), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(60).expand(2, -1)
    with kvcompress.compress(model, stack, max_cache_len=44) as cache, torch.no_grad():
        model(ids[:, :24], position_ids=pos[:, :24], past_key_values=cache)
        flushes = []
        for i in range(24, 44):
            key = cache.plan_step()
            flushes.append(bool(key[0]))
            model(input_ids=ids[:, i:i + 1], position_ids=pos[:, i:i + 1], past_key_values=cache)
            cache.finish_step(True)
            for core in cache.compressed_layers:
                assert core._host is not None and core._host == (int(core.seen), int(core.flushed))
        # residual 16 + group 16: a block leaves whenever 32 tokens are past the flushed ones
        assert sum(flushes) == sum(1 for n in range(25, 45) if (n - 16) % 16 == 0)
        with pytest.raises(UnsupportedOperationError, match="is full"):
            cache.plan_step()
        assert all(core._planned is None for core in cache.compressed_layers)
        cache.reset()
        model(ids[:, :24], position_ids=pos[:, :24], past_key_values=cache)
        cache.plan_step()
        with pytest.raises(UnsupportedOperationError, match="planned twice"):
            cache.plan_step()
        cache.finish_step(False)
        cache.plan_step()
        with pytest.raises(UnsupportedOperationError, match="was called with 3 tokens"):
            model(input_ids=ids[:, 24:27], position_ids=pos[:, 24:27], past_key_values=cache)
        cache.finish_step(False)  # the counts are forgotten and read again from the device
        assert all(core._host is None for core in cache.compressed_layers)
        assert cache.compressed_layers[0].host_counts()[0] == 24


def test_graph_step_plans_around_each_call_and_reports_a_failed_call():
    events = []

    class Planner:
        def plan_step(self):
            events.append("plan")
            return len(events)

        def finish_step(self, completed):
            events.append(("finish", completed))

    def fn(x, cache, fail=False):
        events.append("call")
        if fail:
            raise RuntimeError("boom")
        return x + 1

    step = GraphStep(fn, warmup=1)
    planner = Planner()
    step(x=torch.zeros(2), cache=planner)
    with pytest.raises(RuntimeError, match="boom"):
        step(x=torch.zeros(2), cache=planner, fail=True)
    assert events == ["plan", "call", ("finish", True), "plan", "call", ("finish", False)]
    with pytest.raises(ValueError, match="variant_warmup must be >= 1"):
        GraphStep(fn, variant_warmup=0)


def _bind_step(static):
    step = GraphStep(lambda **kw: None, warmup=1)
    step._static = static
    return step


def test_changed_arguments_are_refused_with_what_changed():
    held = torch.zeros(2, 1, dtype=torch.long)
    cache = object()
    step = _bind_step({"input_ids": held, "past_key_values": cache, "logits_to_keep": 1})
    new = torch.full((2, 1), 7)
    step._bind({"input_ids": new, "past_key_values": cache, "logits_to_keep": 1})
    assert torch.equal(held, new)  # copied into the captured buffer
    with pytest.raises(UnsupportedOperationError, match=r"captured 'input_ids' as \(2, 1\).*got \(3, 1\)"):
        step._bind({"input_ids": torch.zeros(3, 1, dtype=torch.long), "past_key_values": cache, "logits_to_keep": 1})
    with pytest.raises(UnsupportedOperationError, match="argument 'past_key_values' changed"):
        step._bind({"input_ids": new, "past_key_values": object(), "logits_to_keep": 1})
    with pytest.raises(UnsupportedOperationError, match="called with"):
        step._bind({"input_ids": new, "past_key_values": cache})
    # accepts() answers what _bind would do, without copying
    assert step.accepts(input_ids=torch.ones(2, 1, dtype=torch.long), past_key_values=cache, logits_to_keep=1)
    assert torch.equal(held, new)
    assert not step.accepts(input_ids=torch.zeros(3, 1, dtype=torch.long), past_key_values=cache, logits_to_keep=1)
    assert not step.accepts(input_ids=new, past_key_values=object(), logits_to_keep=1)
    assert not step.accepts(input_ids=new, past_key_values=cache)
    assert GraphStep(lambda **kw: None).accepts(anything=1)  # nothing captured yet


CUDA_STACKS = {
    "none": [],
    "window": [{"window": {"sinks": 2, "recent": 16}}],
    "kivi2": [{"kivi": {"bits": 2, "group": 16, "residual": 16}}],
    "paged+kivi2": [{"paged_eviction": {"budget": 64, "block": 16}}, {"kivi": {"bits": 2, "group": 16, "residual": 16}}],
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CUDA_STACKS))
def test_cuda_graph_replay_equals_eager(name):
    from kvcompress.evaluation.runner import graph_compile_options, graph_step

    model = tiny_model("llama").cuda()
    stack = kvcompress.parse_stack({"compressors": CUDA_STACKS[name]})
    torch._dynamo.reset()
    eager, _ = _decode(model, stack, 48, device="cuda")
    replayed, fn = _decode(model, stack, 48, step_fn=lambda m: graph_step(m, warmup=2), device="cuda")
    # one graph per plan: the steps that flush a block (every 16th for KIVI) have their own, captured after one
    # direct call (where that variant compiles)
    flushes = name in ("kivi2", "paged+kivi2")
    assert len(fn.variants) == (2 if flushes else 1) and fn.direct_calls == (3 if flushes else 2)
    assert fn.replays == 48 - fn.direct_calls
    # the replay runs the compiled step's kernels: bit-identical to that step called without a graph (there
    # unplanned: a block offered every step, the device deciding)
    torch._dynamo.reset()
    compiled, _ = _decode(model, stack, 48, device="cuda", step_fn=lambda m: torch.compile(
        m.forward, **graph_compile_options(torch.device("cuda"))))
    torch.testing.assert_close(replayed, compiled, rtol=0, atol=0)
    # and equal to the eager step up to Inductor's fused arithmetic (4e-5 measured with KIVI-2 on an H200)
    torch.testing.assert_close(replayed, eager, rtol=0, atol=2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replays_the_cuda_select_of_double_sparse(monkeypatch):
    """DoubleSparse with its CUDA select (kernels/doublesparse/radix_cuda.cu; forced here: ``"auto"`` takes it only
    for long contexts): the graph replays equal the same compiled step called directly, and the select ran."""
    from kvcompress.evaluation.runner import graph_compile_options, graph_step
    from kvcompress.kernels.doublesparse import radix_cuda, triton_kernel

    calls = []
    real = radix_cuda.select_topk_cuda
    monkeypatch.setattr(radix_cuda, "select_topk_cuda", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("KVCOMPRESS_DS_CONFIG", '{"method": "cuda"}')
    triton_kernel._env_config.cache_clear()
    try:
        model = tiny_model("llama").cuda()
        stack = kvcompress.parse_stack({"compressors": [{"double_sparse": {
            "channels": "random", "r": 8, "k": 24, "dense_layers": 0, "sinks": 2, "window": 8}}]})
        torch._dynamo.reset()
        replayed, fn = _decode(model, stack, 24, step_fn=lambda m: graph_step(m, warmup=2), device="cuda")
        assert fn.replays > 0 and calls, "no replay, or the CUDA select never ran"
        torch._dynamo.reset()
        compiled, _ = _decode(model, stack, 24, device="cuda", step_fn=lambda m: torch.compile(
            m.forward, **graph_compile_options(torch.device("cuda"))))
        torch.testing.assert_close(replayed, compiled, rtol=0, atol=0)
    finally:
        triton_kernel._env_config.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shared", [False, True])
def test_cuda_graph_replays_the_one_kernel_double_sparse_read(monkeypatch, shared):
    """DoubleSparse with ``fuse_gather`` on: the static cache chooses the one-kernel select + gather at build, the
    captured step runs it (``kvcompress::select_gather``, Triton) and its replays equal the two-kernel read's (the
    same selection: the same select code), per query head and group-shared."""
    from kvcompress.evaluation.runner import graph_step
    from kvcompress.kernels.doublesparse import triton_kernel

    model = tiny_model("llama").cuda()
    stack = kvcompress.parse_stack({"compressors": [{"double_sparse": {
        "channels": "random", "r": 8, "k": 24, "dense_layers": 0, "sinks": 2, "window": 8, "group_shared": shared}}]})
    runs, calls = [], []
    real = triton_kernel.select_gather_partial
    monkeypatch.setattr(triton_kernel, "select_gather_partial", lambda *a, **k: calls.append(1) or real(*a, **k))
    try:
        for config in ('{"fuse_gather": false}', '{"fuse_gather": true}'):
            monkeypatch.setenv("KVCOMPRESS_DS_CONFIG", config)
            triton_kernel._env_config.cache_clear()
            torch._dynamo.reset()
            logits, fn = _decode(model, stack, 24, step_fn=lambda m: graph_step(m, warmup=2), device="cuda")
            assert fn.replays > 0
            runs.append((logits, len(calls)))
    finally:
        triton_kernel._env_config.cache_clear()
        torch._dynamo.reset()
    (two, before), (one, after) = runs
    assert before == 0 and after > 0, "the one-kernel read did not run (or ran with fuse_gather off)"
    torch.testing.assert_close(one, two, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_capture_of_a_host_reading_step_fails_clearly():
    step = GraphStep(lambda x: x * int(x.sum()), warmup=1)
    x = torch.ones(4, device="cuda")
    step(x=x)
    with pytest.raises(UnsupportedOperationError, match="could not be captured as a CUDA graph"):
        step(x=x)


def test_step_generate_equals_generate_and_samples_through_the_warpers():
    """``hf.step_generate`` (what ``generate --compile`` runs): greedy tokens equal ``model.generate``'s on the
    same static cache; sampling with top_k = 1 goes through transformers' warpers and equals greedy; a row that
    hits the end-of-sequence token continues with padding, as generate does."""
    from kvcompress.adapters import hf

    model = tiny_model("llama")
    stack = kvcompress.parse_stack({"compressors": [{"window": {"sinks": 2, "recent": 12}}]})
    ids = torch.randint(1, 256, (2, 10), generator=torch.Generator().manual_seed(5))

    def run(fn, **kw):
        with kvcompress.compress(model, stack, max_cache_len=40) as cache, torch.no_grad():
            return fn(cache, **kw)

    kw = hf.cache_kwarg(model)
    ref = run(lambda c: model.generate(ids, **{kw: c}, max_new_tokens=24, do_sample=False, pad_token_id=0))
    greedy = run(lambda c: hf.step_generate(model, ids, c, model.forward, 24))
    assert torch.equal(greedy, ref)
    config = model.generation_config
    saved = (config.top_k, config.temperature, config.eos_token_id)
    try:
        config.top_k, config.temperature = 1, 0.7
        sampled = run(lambda c: hf.step_generate(model, ids, c, model.forward, 24, do_sample=True,
                                                 generator=torch.Generator().manual_seed(0)))
        assert torch.equal(sampled, ref)
        config.eos_token_id = int(ref[0, 14])  # row 0 ends at its 5th new token
        ended = run(lambda c: hf.step_generate(model, ids, c, model.forward, 24, pad_token_id=0))
    finally:
        config.top_k, config.temperature, config.eos_token_id = saved
    first = int((ref[0, 10:] == ref[0, 14]).nonzero()[0]) + 10
    assert torch.equal(ended[0, :first + 1], ref[0, :first + 1]) and (ended[0, first + 1:] == 0).all()


def test_generate_graphs_route_planned_steps_through_one_graph_step_per_cache():
    """What ``generate``'s default compiled step runs inside ``compress`` on one CUDA device (``hf.PlannedCall`` with
    an ``hf.CompiledForward``): every single-token step of a static cache goes through one GraphStep, which plans it
    (here on the CPU as direct calls, compiled with aot_eager); the logits equal the eager static cache's over steps
    that flush KIVI blocks; a step on another cache gets a new GraphStep; multi-token calls go to transformers'
    call."""
    from kvcompress.adapters import hf

    model = tiny_model("llama")
    stack = kvcompress.parse_stack({"compressors": [{"kivi": {"bits": 2, "group": 16, "residual": 16}}]})
    forward = hf.CompiledForward(model, {"backend": "aot_eager", "fullgraph": True})
    torch._dynamo.reset()
    eager, _ = _decode(model, stack, 40)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 256, (2, 64), generator=g)  # _decode's tokens
    pos = torch.arange(64).expand(2, -1)
    chunks = []
    step = hf.PlannedCall(lambda **kw: chunks.append(kw["input_ids"].shape[1]) or model(**kw), forward)
    out = []
    with kvcompress.compress(model, stack, max_cache_len=68) as cache, torch.no_grad():
        step(input_ids=ids[:, :24], position_ids=pos[:, :24], past_key_values=cache)  # the prompt: transformers' call
        for i in range(24, 64):
            o = step(input_ids=ids[:, i:i + 1].clone(), position_ids=pos[:, i:i + 1].clone(), past_key_values=cache,
                     logits_to_keep=1)
            out.append(o.logits[:, -1].float())
        first = step.graph_step
        assert chunks == [24] and forward.calls == 40
        assert first.calls == 40 and first.direct_calls == 40  # the CPU: no graph, every call direct
        assert not cache.step_planned and all(int(core.flushed) >= 32 for core in cache.compressed_layers)
    torch.testing.assert_close(torch.stack(out), eager, rtol=0, atol=1e-5)
    with kvcompress.compress(model, stack, max_cache_len=68) as other, torch.no_grad():
        model(ids[:, :24], position_ids=pos[:, :24], past_key_values=other)
        step(input_ids=ids[:, 24:25], position_ids=pos[:, 24:25], past_key_values=other, logits_to_keep=1)
    if first._static is not None:  # on CUDA the first GraphStep bound its arguments: another cache needs a new one
        assert step.graph_step is not first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["none", "kivi2"])
def test_cuda_generate_replays_kvcompress_graphs(name):
    """``model.generate`` on CUDA inside ``compress`` with a static cache and no ``compile_config``: its decode steps
    replay kvcompress' GraphStep graphs (the compiled forward runs only in the warm-up and capture calls, one graph
    per plan key) and give the tokens of generate without compilation (fp32); a second generate continuing on the
    same cache gives the tokens of one long generate."""
    from kvcompress.adapters import hf

    model = tiny_model("llama").cuda()
    stack = kvcompress.parse_stack({"compressors": CUDA_STACKS[name]})
    ids = torch.randint(1, 256, (2, 20), generator=torch.Generator().manual_seed(7)).cuda()
    kw = hf.cache_kwarg(model)
    torch._dynamo.reset()
    with kvcompress.compress(model, stack, max_cache_len=100) as cache:
        ref = model.generate(ids, max_new_tokens=72, do_sample=False, disable_compile=True, **{kw: cache})
    with kvcompress.compress(model, stack, max_cache_len=100) as cache:
        out = model.generate(ids, max_new_tokens=48, do_sample=False, **{kw: cache})
        forward = model.get_compiled_call(None).graph_fn
        # 47 decode steps: 2 warm-up calls and a capture, plus a warm-up call and a capture for KIVI's flush variant
        assert forward is not None and forward.calls == (5 if name == "kivi2" else 3), forward.calls
        more = model.generate(out, max_new_tokens=24, do_sample=False, **{kw: cache})
    assert torch.equal(out, ref[:, :out.shape[1]])
    assert torch.equal(more, ref)
