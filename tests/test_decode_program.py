"""models/step.py: steps on the lean path (the layers' forward methods called directly, on the
step's buffers) equal the module path bit for bit, and give way to it wherever a hook could be
skipped, the model's modules changed, or a step is batch-invariant."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from conftest import make_random_model
from torch import nn

from llmctl.engine.params import SamplingParams
from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu.library import load
from llmctl.kernels.cpu.linear import autotune, c_kernels
from llmctl.llm import LLM
from llmctl.models import step as steps
from llmctl.models.layers import Linear
from llmctl.models.prepare import Serving, prepare_for_inference

needs_native = pytest.mark.skipif(
    load("core") is None, reason="no C compiler: the lean path needs the native kernels"
)
pytestmark = needs_native


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request, tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp(request.param), request.param)


def _engine(folder, **kw) -> LLM:
    return LLM(str(folder), dtype="bfloat16", device="cpu", enable_prefix_caching=False, **kw)


def _lean_rows(monkeypatch) -> list[int]:
    """The row count of every step that takes the lean path from now on."""
    rows, begin = [], steps.begin

    def counted(model, input_ids, *args):
        step = begin(model, input_ids, *args)
        if step is not None:
            rows.append(input_ids.shape[0])
        return step

    monkeypatch.setattr(steps, "begin", counted)
    return rows


def _checked(model, monkeypatch) -> list[int]:
    """Make each step also run the module path (the lean path off) on copies of the caches, and
    assert both give the same hidden states and cache contents; returns the row counts of the
    steps that took the lean path."""
    rows, forward = _lean_rows(monkeypatch), type(model).forward

    def both(input_ids, positions, meta, kv_caches):
        caches = [(k.clone(), v.clone()) for k, v in kv_caches]
        lean, model.lean = model.lean, None
        try:
            ref = forward(model, input_ids, positions, meta, caches)
        finally:
            model.lean = lean
        out = forward(model, input_ids, positions, meta, kv_caches)
        assert torch.equal(out, ref)
        for (k, v), (rk, rv) in zip(kv_caches, caches):  # as bytes: fp8 has no torch.equal
            assert torch.equal(_bytes(k), _bytes(rk)) and torch.equal(_bytes(v), _bytes(rv))
        return out

    monkeypatch.setattr(model, "forward", both)
    return rows


def _plans(model, name: str, max_rows: int = 256) -> None:
    """Every linear planned to `name` at every row count (as the autotuner could choose)."""
    choices = {b: name for b in autotune.buckets(max_rows)}
    for m in model.modules():
        if type(m) is Linear:
            m.plan = autotune.Plan(choices, max_rows)
    for layer in model.layers:
        for block in (layer.self_attn, layer.mlp):
            block.merged.linear.plan = autotune.Plan(choices, max_rows)


KERNELS = ["static", "torch"] + (["dpbf16"] if c_kernels.dpbf16_library() is not None else [])
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("attention", ["default", "generic"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_lean_steps_equal_the_module_path(tiny, kernel, attention, monkeypatch):
    """Batches of 1, 5 and 70 decodes (the KV write and RoPE switch paths at 16 and 64 rows),
    each linear through the static rules, F.linear, or the bf16 dot-product kernel; decode
    attention through the AVX512-BF16 kernel where the CPU has it, or the generic bf16 one (what
    CPUs without it run)."""
    if attention == "generic":
        monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0,decode_attention=generic")
    llm = _engine(tiny)
    model = llm.runtime.model
    assert model.lean is not None
    if kernel != "static":
        _plans(model, kernel)
    seen = _checked(model, monkeypatch)
    for n in (1, 5, 70):
        prompts = [[int(t) for t in torch.randint(3, 150, (4 + i % 9,))] for i in range(n)]
        llm.generate(prompts, GREEDY)
        assert n in seen  # steps of this batch took the lean path


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("cache", ["fp8", "fp8_e5m2", "int8"])
def test_lean_steps_on_a_quantized_cache_equal_the_module_path(tiny, cache, monkeypatch):
    """--kv-cache-dtype fp8: the lean step converts K/V on write and its decode kernel reads the
    bytes, as the module path does."""
    llm = _engine(tiny, kv_cache_dtype=cache)
    seen = _checked(llm.runtime.model, monkeypatch)
    for n in (1, 5, 70):
        prompts = [[int(t) for t in torch.randint(3, 150, (4 + i % 9,))] for i in range(n)]
        llm.generate(prompts, GREEDY)
        assert n in seen


def test_separate_projections_equal_the_module_path(tiny, monkeypatch):
    monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0,merge_linears=0")
    llm = _engine(tiny)
    seen = _checked(llm.runtime.model, monkeypatch)
    llm.generate([[5, 6, 7], list(range(3, 40))], GREEDY)
    assert 2 in seen


def test_greedy_tokens_with_and_without_the_lean_path(tiny, monkeypatch):
    prompts = [[int(t) for t in torch.randint(3, 150, (n,))] for n in (3, 30, 11)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    lean = _engine(tiny)
    assert lean.runtime.model.lean is not None
    tokens = [o.output_token_ids for o in lean.generate(prompts, params)]
    monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0,decode_program=0")
    plain = _engine(tiny)
    assert plain.runtime.model.lean is None
    assert [o.output_token_ids for o in plain.generate(prompts, params)] == tokens


def _decode_step_taken(llm, monkeypatch) -> bool:
    """Whether the next decode step of a fresh request takes the lean path."""
    with monkeypatch.context() as m:
        rows = _lean_rows(m)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    return 1 in rows


def test_a_hook_sends_steps_back_to_the_module_path(tiny, monkeypatch):
    llm = _engine(tiny)
    model = llm.runtime.model
    assert _decode_step_taken(llm, monkeypatch)
    calls = []
    handle = model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda m, args: calls.append(args[0].shape[0])
    )
    assert not _decode_step_taken(llm, monkeypatch)
    assert 1 in calls  # the hook saw the one-row decode steps
    handle.remove()
    assert _decode_step_taken(llm, monkeypatch)
    handle = model.rotary.register_forward_hook(lambda m, args, out: None)
    assert not _decode_step_taken(llm, monkeypatch)
    handle.remove()
    handle = model.layers[1].mlp.merged.linear.register_forward_hook(lambda m, a, out: None)
    assert not _decode_step_taken(llm, monkeypatch)
    handle.remove()
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, args: None)
    try:
        assert not _decode_step_taken(llm, monkeypatch)
    finally:
        handle.remove()


@pytest.mark.parametrize("change", ["module", "parameter", "memory", "merge"])
def test_a_changed_model_takes_the_module_path(tiny, change, monkeypatch):
    """What prepare checked once for the lean path (plain bf16 weights, live merged linears), or
    a module that may carry hooks no step checked, no longer holds: the module path serves."""
    llm = _engine(tiny)
    model = llm.runtime.model
    attn = model.layers[-1].self_attn
    if change == "module":  # e.g. quantized after the engine started
        o = attn.o_proj
        attn.o_proj = Linear(o.in_features, o.out_features, bias=False).to(torch.bfloat16)
    elif change == "parameter":
        down = model.layers[0].mlp.down_proj
        down.weight = nn.Parameter(down.weight * 1)
    elif change == "memory":
        model.model.norm.weight.data = model.model.norm.weight.data.clone()
    else:  # the q/k/v parts no longer view the merged weight
        attn.k_proj.weight = nn.Parameter(attn.k_proj.weight.detach().clone())
    assert not model.lean.unchanged()
    assert not _decode_step_taken(llm, monkeypatch)


def test_not_taken_where_it_does_not_apply(tiny, monkeypatch):
    assert LLM(str(tiny), dtype="float32", device="cpu").runtime.model.lean is None
    monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0,decode_program=0")
    assert _engine(tiny).runtime.model.lean is None
    monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0,native=0")  # the buffers are C kernels'
    assert _engine(tiny).runtime.model.lean is None


def test_prefill_and_speculative_steps_equal_the_module_path(tiny, monkeypatch):
    """Steps with prompt chunks (alone, with decodes, split over steps by a small token budget)
    and n-gram speculation's verification steps take the lean path too."""
    llm = _engine(tiny, max_num_batched_tokens=32, speculative="ngram")
    model = llm.runtime.model
    seen, forward, kinds = _checked(model, monkeypatch), model.forward, []

    def recorded(ids, pos, meta, kv):
        kinds.append((meta.num_decodes, len(meta.prefills)))
        return forward(ids, pos, meta, kv)

    monkeypatch.setattr(model, "forward", recorded)
    repeat = [5, 6, 7, 8] * 6  # n-gram proposals find this pattern
    prompts = [repeat, [int(t) for t in torch.randint(3, 150, (70,))], repeat[:9]]
    llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert len(seen) == len(kinds) > 0  # every step lean, and checked
    assert any(d == 0 for d, _ in kinds)  # prompt chunks alone
    assert any(d and p for d, p in kinds)  # chunks beside decodes
    assert llm.engine.stats.spec_proposed > 0  # verification steps ran (and were checked)


def test_batch_invariant_steps_take_the_module_path(tiny, monkeypatch):
    inv = _engine(tiny, batch_invariant=True)
    rows = _lean_rows(monkeypatch)
    inv.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert not rows


def test_a_context_beyond_its_block_table_is_refused(tiny, monkeypatch):
    """The kernels index by the metadata: the lean path checks it as the module path does."""
    llm = _engine(tiny)
    model = llm.runtime.model
    forward, errors, rows = type(model).forward, [], _lean_rows(monkeypatch)

    def too_long(input_ids, positions, meta, kv_caches):
        if meta.num_decodes == input_ids.shape[0]:  # a prompt: no decode kernel to guard
            bad = copy.copy(meta)
            bad.decode_max_len = meta.decode_block_tables.shape[1] * meta.block_size + 1
            with pytest.raises(ValueError, match="max_len"):
                forward(model, input_ids, positions, bad, kv_caches)
            errors.append(1)
        return forward(model, input_ids, positions, meta, kv_caches)

    monkeypatch.setattr(model, "forward", too_long)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert errors and 1 in rows


def test_the_lean_record_keeps_no_dropped_model_alive(tiny):
    """The model holds its `Watch`; the record must not hold the model (a cycle would keep the
    weights until the garbage collector runs)."""
    from llmctl.runtime.weights import load_model

    model, _ = load_model(tiny, "bfloat16", "cpu")
    prepare_for_inference(
        model, KernelConfig(autotune=False), Serving("cpu", torch.bfloat16, 64, 8)
    )
    assert model.lean is not None
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()
