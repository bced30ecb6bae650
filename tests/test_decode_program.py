"""models/decode_program.py: decode steps as direct kernel calls equal the module path bit for bit,
and give way to it wherever the model changed or a step is not one-token decodes only."""

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
from llmctl.models.layers import Linear
from llmctl.models.prepare import Serving, prepare_for_inference

needs_native = pytest.mark.skipif(
    load("core") is None, reason="no C compiler: the program needs the native kernels"
)
pytestmark = needs_native


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request, tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp(request.param), request.param)


def _engine(folder, **kw) -> LLM:
    return LLM(str(folder), dtype="bfloat16", device="cpu", enable_prefix_caching=False, **kw)


def _checked(model):
    """Make each program step also run the module path on copies of the caches, and assert both
    give the same hidden states and cache contents; returns the row counts seen."""
    program, seen = model.decode_program, []
    run = program.run

    def both(input_ids, positions, meta, kv_caches):
        caches = [(k.clone(), v.clone()) for k, v in kv_caches]
        model.decode_program = None
        try:
            ref = model(input_ids, positions, meta, caches)
        finally:
            model.decode_program = program
        out = run(input_ids, positions, meta, kv_caches)
        assert torch.equal(out, ref)
        for (k, v), (rk, rv) in zip(kv_caches, caches):
            assert torch.equal(k, rk) and torch.equal(v, rv)
        seen.append(input_ids.shape[0])
        return out

    program.run = both
    return seen


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


@pytest.mark.parametrize("attention", ["default", "generic"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_program_steps_equal_the_module_path(tiny, kernel, attention, monkeypatch):
    """Batches of 1, 5 and 70 decodes (the KV write and RoPE switch paths at 16 and 64 rows),
    each linear through the static rules, F.linear, or the bf16 dot-product kernel (into the
    program's buffers); decode attention through the AVX512-BF16 kernel where the CPU has it, or
    the generic bf16 one (what CPUs without it run)."""
    if attention == "generic":
        monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0,decode_attention=generic")
    llm = _engine(tiny)
    model = llm.runtime.model
    assert model.decode_program is not None
    if kernel != "static":
        _plans(model, kernel)
    seen = _checked(model)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    for n in (1, 5, 70):
        prompts = [[int(t) for t in torch.randint(3, 150, (4 + i % 9,))] for i in range(n)]
        llm.generate(prompts, params)
        assert n in seen  # the program served steps of this batch


def test_greedy_tokens_with_and_without_the_program(tiny, monkeypatch):
    prompts = [[int(t) for t in torch.randint(3, 150, (n,))] for n in (3, 30, 11)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with_program = _engine(tiny)
    assert with_program.runtime.model.decode_program is not None
    tokens = [o.output_token_ids for o in with_program.generate(prompts, params)]
    monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0,decode_program=0")
    plain = _engine(tiny)
    assert plain.runtime.model.decode_program is None
    assert [o.output_token_ids for o in plain.generate(prompts, params)] == tokens


def _decode_step_taken(llm) -> bool:
    """Whether the program served the next decode step of a fresh request."""
    program = llm.runtime.model.decode_program
    served, run = [], program.run
    program.run = lambda *a: served.append(1) or run(*a)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    program.run = run
    return bool(served)


def test_a_hook_sends_steps_back_to_the_module_path(tiny):
    llm = _engine(tiny)
    model = llm.runtime.model
    assert _decode_step_taken(llm)
    calls = []
    handle = model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda m, args: calls.append(args[0].shape[0])
    )
    assert not _decode_step_taken(llm)
    assert 1 in calls  # the hook saw the one-row decode steps
    handle.remove()
    assert _decode_step_taken(llm)
    handle = model.rotary.register_forward_hook(lambda m, args, out: None)
    assert not _decode_step_taken(llm)
    handle.remove()
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, args: None)
    try:
        assert not _decode_step_taken(llm)
    finally:
        handle.remove()


@pytest.mark.parametrize("change", ["module", "parameter", "memory", "merge"])
def test_a_changed_model_is_not_served(tiny, change):
    llm = _engine(tiny)
    model = llm.runtime.model
    attn = model.layers[-1].self_attn
    if change == "module":  # e.g. quantized after the engine started
        attn.o_proj = Linear(attn.o_proj.in_features, attn.o_proj.out_features, bias=False).to(
            torch.bfloat16
        )
    elif change == "parameter":
        down = model.layers[0].mlp.down_proj
        down.weight = nn.Parameter(down.weight * 1)
    elif change == "memory":
        model.model.norm.weight.data = model.model.norm.weight.data.clone()
    else:  # the q/k/v parts no longer view the merged weight
        attn.k_proj.weight = nn.Parameter(attn.k_proj.weight.detach().clone())
    assert not model.decode_program.current()
    assert not _decode_step_taken(llm)


def test_not_built_where_it_does_not_apply(tiny, monkeypatch):
    assert LLM(str(tiny), dtype="float32", device="cpu").runtime.model.decode_program is None
    # separate projections: nothing to read
    monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0,merge_linears=0")
    assert _engine(tiny).runtime.model.decode_program is None
    monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0,decode_program=0")
    assert _engine(tiny).runtime.model.decode_program is None
    monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0,native=0")  # the program calls C kernels
    assert _engine(tiny).runtime.model.decode_program is None


def test_prefill_and_speculative_steps_equal_the_module_path(tiny):
    """Steps with prompt chunks (alone, with decodes, split over steps by a small token budget)
    and n-gram speculation's verification steps go through paged_attention in the program."""
    llm = _engine(tiny, max_num_batched_tokens=32, speculative="ngram")
    model = llm.runtime.model
    seen = _checked(model)
    steps = []
    run = model.decode_program.run
    model.decode_program.run = lambda ids, pos, meta, kv: (
        steps.append((ids.shape[0], meta.num_decodes, len(meta.prefills)))
        or run(ids, pos, meta, kv)
    )
    repeat = [5, 6, 7, 8] * 6  # n-gram proposals find this pattern
    prompts = [repeat, [int(t) for t in torch.randint(3, 150, (70,))], repeat[:9]]
    llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert len(seen) == len(steps) > 0
    assert any(d == 0 for _, d, _ in steps)  # prompt chunks alone
    assert any(d and p for _, d, p in steps)  # chunks beside decodes
    assert llm.engine.stats.spec_proposed > 0  # verification steps ran (and were checked)


def test_batch_invariant_steps_take_the_module_path(tiny):
    inv = _engine(tiny, batch_invariant=True)
    program = inv.runtime.model.decode_program
    served, run = [], program.run
    program.run = lambda *a: served.append(1) or run(*a)
    inv.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert not served


def test_a_context_beyond_its_block_table_is_refused(tiny):
    """The kernels index by the metadata: the program checks it as the attention wrapper does."""
    llm = _engine(tiny)
    program = llm.runtime.model.decode_program
    errors, run = [], program.run

    def too_long(input_ids, positions, meta, kv_caches):
        if meta.num_decodes != input_ids.shape[0]:  # a prompt: no decode kernel to guard
            return run(input_ids, positions, meta, kv_caches)
        bad = copy.copy(meta)
        bad.decode_max_len = meta.decode_block_tables.shape[1] * meta.block_size + 1
        with pytest.raises(ValueError, match="max_len"):
            run(input_ids, positions, bad, kv_caches)
        errors.append(1)
        return run(input_ids, positions, meta, kv_caches)

    program.run = too_long
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert errors


def test_the_program_keeps_no_dropped_model_alive(tiny):
    """The model holds its program; the program must not hold the model (a cycle would keep the
    weights until the garbage collector runs)."""
    from llmctl.runtime.weights import load_model

    model, _ = load_model(tiny, "bfloat16", "cpu")
    prepare_for_inference(
        model, KernelConfig(autotune=False), Serving("cpu", torch.bfloat16, 64, 8)
    )
    assert model.decode_program is not None
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()
