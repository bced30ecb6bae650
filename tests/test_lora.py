"""LoRA adapters in the engine (Python API): two PEFT adapters with random non-zero weights on
different projections of the tinyshakespeare fixture, mixed with base prompts in one engine,
greedy tokens equal to transformers + PEFT with the adapter merged, in float32; the prefix cache
keyed by adapter; preemption; adapters PEFT folders that llmctl refuses."""

from __future__ import annotations

import json

import pytest

from llmctl import LLM, LoRARequest, SamplingParams
from llmctl.errors import UsageError
from llmctl.runtime.lora import load_adapter
from tests.lora_helpers import adapters, merged_greedy  # noqa: F401 (a fixture)

MAX_NEW = 10
TEXTS = [
    "ROMEO:",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "KING RICHARD III:\nNow is the winter of our discontent",
]


@pytest.fixture(scope="module")
def references(shakespeare_model, adapters):
    """name (None: the base) -> greedy tokens per text, from transformers + merged PEFT."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(shakespeare_model))
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    refs = {None: merged_greedy(shakespeare_model, None, prompts, MAX_NEW)}
    for name, folder in adapters.items():
        refs[name] = merged_greedy(shakespeare_model, folder, prompts, MAX_NEW)
    assert refs["attn"] != refs[None] and refs["mlp"] != refs[None]  # the adapters do something
    return prompts, refs


def _mixed(adapters, prompts):
    """Every prompt under the base and each adapter, interleaved: (prompt, request, name)."""
    jobs = []
    for i, p in enumerate(prompts):
        jobs.append((p, None, None))
        for k, name in enumerate(adapters):
            jobs.append((p, LoRARequest(name, k + 1, str(adapters[name])), name))
    return jobs


def _run(shakespeare_model, jobs, **kw):
    llm = LLM(str(shakespeare_model), dtype="float32", device="cpu", enable_lora=True, **kw)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outs = llm.generate([j[0] for j in jobs], params, lora_request=[j[1] for j in jobs])
    return [o.output_token_ids for o in outs], llm.engine


def _expected(jobs, prompts, refs):
    return [refs[name][prompts.index(p)] for p, _, name in jobs]


def test_adapters_mixed_with_base_match_merged_peft(shakespeare_model, adapters, references):
    prompts, refs = references
    jobs = _mixed(adapters, prompts)
    ours, engine = _run(shakespeare_model, jobs, max_loras=2, kv_cache_memory=16 * 1024**2)
    assert ours == _expected(jobs, prompts, refs)
    # the adapters' projections are wrapped, the rest keep merging
    assert engine.lora.modules and all(m.base is not None for m in engine.lora.modules)


def test_prefix_cache_is_keyed_by_adapter(shakespeare_model, adapters, references):
    prompts, refs = references
    long = prompts[2]  # 40+ tokens: full blocks of 4 to share
    jobs = [(long, None, None)] + [j for j in _mixed(adapters, [long]) if j[2]] * 2
    ours, engine = _run(
        shakespeare_model, jobs, max_loras=2, block_size=4, kv_cache_memory=16 * 1024**2
    )
    assert ours == [refs[name][2] for _, _, name in jobs]
    bm = engine.block_manager
    full = (len(long) - 1) // 4
    # each adapter's second request hits its own first one's blocks; the base's prefix never
    # serves an adapter (3 distinct roots: 3 chains of cached blocks)
    assert bm.prefix_hits == 2 * full * 4
    roots = {bm.blocks[b].parent_hash for b in bm.hash_to_block.values()}
    assert {None, *(("lora", load_adapter(n, f).digest) for n, f in adapters.items())} <= roots


def test_preemption_keeps_the_adapter(shakespeare_model, adapters, references):
    prompts, refs = references
    jobs = _mixed(adapters, prompts) * 2  # 3072 bytes a token: a cache of 16 blocks of 4
    ours, engine = _run(
        shakespeare_model, jobs, max_loras=2, block_size=4, kv_cache_memory=16 * 4 * 3072
    )
    assert engine.scheduler.num_preemptions > 0
    assert ours == _expected(jobs, prompts, refs)


def test_one_slot_serves_adapters_one_after_another(shakespeare_model, adapters, references):
    prompts, refs = references
    llm = LLM(str(shakespeare_model), dtype="float32", device="cpu", enable_lora=True)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    for k, name in enumerate(adapters):
        req = LoRARequest(name, k + 1, str(adapters[name]))
        outs = llm.generate(prompts, params, lora_request=req)
        assert [o.output_token_ids for o in outs] == refs[name]
    # both adapters and the base in one call: one slot, so the adapters take turns
    jobs = _mixed(adapters, prompts)
    outs = llm.generate([j[0] for j in jobs], params, lora_request=[j[1] for j in jobs])
    assert [o.output_token_ids for o in outs] == _expected(jobs, prompts, refs)


def test_pickle_and_unsupported_adapters_are_refused(adapters, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        (adapters["attn"] / "adapter_config.json").read_text()
    )
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(UsageError, match="pickle"):
        load_adapter("p", folder)
    for key, value in [("use_dora", True), ("modules_to_save", ["lm_head"]), ("bias", "all")]:
        dora = tmp_path / key
        dora.mkdir()
        config = json.loads((adapters["attn"] / "adapter_config.json").read_text())
        (dora / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        (dora / "adapter_model.safetensors").write_bytes(
            (adapters["attn"] / "adapter_model.safetensors").read_bytes()
        )
        with pytest.raises(UsageError, match=key):
            load_adapter("d", dora)


def test_n_above_one_keeps_the_adapter(shakespeare_model, adapters, references):
    prompts, refs = references
    llm = LLM(str(shakespeare_model), dtype="float32", device="cpu", enable_lora=True)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, n=3)
    outs = llm.generate(prompts, params, lora_request=LoRARequest("mlp", 2, str(adapters["mlp"])))
    for out, ref in zip(outs, refs["mlp"]):
        assert [c.token_ids for c in out.outputs] == [ref] * 3


@pytest.mark.parametrize("fmt,bits", [("gptq", "8"), ("compressed-tensors", "4"), ("awq", "4")])
def test_adapters_on_a_quantized_base(shakespeare_model, adapters, references, tmp_path, fmt, bits):
    """RTN-quantized bases (8-bit: dequantize + matmul; 4-bit: the int4 kernel for up to 32
    rows) against transformers holding the dequantized weights, the adapter merged on top."""
    from llmctl.cli import main
    from llmctl.models.qlinear import QuantLinear
    from llmctl.runtime.formats import read_quantized

    out = tmp_path / "q"
    args = ["quantize", str(shakespeare_model), "-o", str(out), "--rtn", "--bits", bits]
    args += ["--format", fmt]
    small = ["--group-size", "32", "--num-samples", "2", "--seq-len", "32", "--quiet"]
    assert main([*args, *small]) == 0
    _, linears, _ = read_quantized(out)
    weights = {f"{n}.weight": u.dequantize().float() for n, u in linears.items()}
    prompts, _ = references
    jobs = _mixed(adapters, prompts)
    ours, engine = _run(out, jobs, max_loras=2, kv_cache_memory=16 * 1024**2)
    assert all(isinstance(m.base, QuantLinear) for m in engine.lora.modules)
    expected = {
        name: merged_greedy(shakespeare_model, adapters.get(name), prompts, MAX_NEW, weights)
        for name in (None, *adapters)
    }
    want = _expected(jobs, prompts, expected)
    if bits == "8":
        assert ours == want
        return
    # the int4 kernel rounds activations to bf16 (tests/test_quant_engine.py: within 1e-2 of the
    # dequantized float32 matmul), so greedy paths may part late: the first tokens equal, and
    # nearly all; an adapter not applied would part at once
    assert all(o[:4] == w[:4] for o, w in zip(ours, want)), (ours, want)
    same = sum(a == b for o, w in zip(ours, want) for a, b in zip(o, w))
    assert same >= 0.9 * len(jobs) * MAX_NEW


def test_adapters_on_the_transformers_path(shakespeare_model, adapters, references):
    """model_impl="transformers": the wrappers go into transformers' own modules."""
    prompts, refs = references
    jobs = _mixed(adapters, prompts)
    ours, engine = _run(
        shakespeare_model, jobs, max_loras=2, model_impl="transformers", kv_cache_memory=2**24
    )
    assert engine.lora.modules and hasattr(engine.runner.model, "hf")
    assert ours == _expected(jobs, prompts, refs)


def test_an_adapter_of_another_model_is_refused_in_one_line(shakespeare_model, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    small = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=2048,
    )  # fmt: skip
    other = get_peft_model(LlamaForCausalLM(small), LoraConfig(r=2, target_modules=["q_proj"]))
    other.save_pretrained(str(tmp_path / "other"))
    llm = LLM(str(shakespeare_model), dtype="float32", device="cpu", enable_lora=True)
    with pytest.raises(UsageError, match=r"q_proj is \[64 x 64\] in the adapter, \[256 x 256\]"):
        llm.generate(["ROMEO:"], lora_request=LoRARequest("o", 1, str(tmp_path / "other")))


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_num_batched_tokens=7),  # prompts in chunks, beside other rows' decodes
        dict(speculative="ngram", num_speculative_tokens=3),  # drafts verified under the adapter
        dict(enable_prefix_caching=False, block_size=1),
    ],
    ids=["chunked-prefill", "ngram-speculation", "no-prefix-cache"],
)
def test_engine_configurations_keep_each_rows_adapter(shakespeare_model, adapters, references, kw):
    prompts, refs = references
    jobs = _mixed(adapters, prompts)
    ours, engine = _run(shakespeare_model, jobs, max_loras=2, kv_cache_memory=2**24, **kw)
    assert ours == _expected(jobs, prompts, refs)
    if "speculative" in kw:
        assert engine.stats.spec_proposed > 0


def test_chat_takes_a_lora_request(shakespeare_model, adapters, references, monkeypatch):
    prompts, refs = references
    llm = LLM(str(shakespeare_model), dtype="float32", device="cpu", enable_lora=True)
    # the fixture has no chat template: each conversation renders as its one message's tokens
    monkeypatch.setattr(llm.runtime, "apply_chat_template", lambda c, **kw: prompts[c[0]["n"]])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    chats = [[{"role": "user", "content": "x", "n": i}] for i in range(len(prompts))]
    outs = llm.chat(chats, params, lora_request=LoRARequest("attn", 1, str(adapters["attn"])))
    assert [o.output_token_ids for o in outs] == refs["attn"]


@pytest.mark.parametrize("native", [True, False], ids=["c-kernel-merged", "pytorch-unmerged"])
def test_wrapped_projections_stay_merged(shakespeare_model, adapters, references, native):
    """The C kernel's update into the merged q/k/v and gate/up columns, and PyTorch's GEMMs on
    separate projections, give the references' tokens."""
    from llmctl.kernels.config import KernelConfig
    from llmctl.models.lora import LoraMerged

    prompts, refs = references
    jobs = _mixed(adapters, prompts)
    kernels = KernelConfig(native=native, merge_linears=native)
    ours, engine = _run(shakespeare_model, jobs, max_loras=2, kernels=kernels)
    assert ours == _expected(jobs, prompts, refs)
    layer = engine.runner.model.model.layers[0]
    merged = [layer.self_attn.merged, layer.mlp.merged]
    assert all(isinstance(m, LoraMerged) for m in merged) if native else merged == [None, None]


@pytest.mark.parametrize("native", [True, False], ids=["c-kernel", "pytorch"])
def test_batch_invariant_rows_keep_their_adapter(shakespeare_model, adapters, references, native):
    """--batch-invariant with adapters: the references' tokens, and each row's logprobs bit for
    bit the same in the mixed batch as alone (its adapter's update does not depend on the
    batch)."""
    from llmctl.kernels.config import KernelConfig

    prompts, refs = references
    jobs = _mixed(adapters, prompts)
    llm = LLM(
        str(shakespeare_model), dtype="float32", device="cpu", enable_lora=True, max_loras=2,
        batch_invariant=True, kernels=KernelConfig(native=native),
    )  # fmt: skip
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=0)

    def run(js):
        outs = llm.generate([j[0] for j in js], params, lora_request=[j[1] for j in js])
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]

    together = run(jobs)
    assert [t for t, _ in together] == _expected(jobs, prompts, refs)
    assert [run([j])[0] for j in jobs] == together
