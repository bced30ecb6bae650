"""Structured outputs on the engine (the embedded demo model, float32, CPU): every constrained
output complies, incomplete ones say so, and the constraint holds with n > 1, speculative
decoding, preemption, chunked prefill and batch invariance; the constraint's own checks and errors
(engine/structured.py) and the mask kernel against its reference (engine/grammar.py)."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl import LLM, SamplingParams, StructuredOutputsParams
from llmctl.engine.grammar import allowed, mask_rows_reference
from llmctl.engine.structured import check_output, grammar_of
from llmctl.errors import RequestError
from llmctl.kernels.cpu import elementwise

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "mood": {"enum": ["happy", "sad"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    {"json": PERSON},
    {"json_object": True},
    {"choice": ["ROMEO", "JULIET", "the nurse"]},
    {"regex": r"[A-Z][a-z]{2,5}, [a-z]{3}\."},
    {"grammar": 'root ::= "yes" | "no" | "maybe so"'},
]
PROMPTS = ["ROMEO:", "JULIET:\nWhat say you, sir?", "First Citizen:\nSpeak", "KING:"]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", max_model_len=256)


def constrained(so, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 48, "temperature": 0, **kw}, structured_outputs=so)


def assert_complies(so: dict, text: str) -> None:
    kind, value = next(iter(so.items()))
    if kind == "json":
        import jsonschema

        jsonschema.validate(json.loads(text), value)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "choice":
        assert text in value
    elif kind == "grammar":
        assert text in ("yes", "no", "maybe so")
    else:
        import re

        assert re.fullmatch(value, text), text


@pytest.mark.parametrize("so", CONSTRAINTS, ids=lambda so: next(iter(so)))
def test_greedy_outputs_comply(llm, so):
    outs = llm.generate(PROMPTS, constrained(so), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        if c.structured_output == "incomplete":  # json_object may run on: then it says so
            assert so == {"json_object": True} and c.finish_reason == "length"
            continue
        assert c.structured_output == "valid", (c.text, c.structured_output_error)
        assert c.finish_reason == "stop"
        assert_complies(so, c.text)


def test_unconstrained_text_would_not_comply(llm):
    """The test above proves something: the demo model left alone writes no JSON."""
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    assert check_output(StructuredOutputsParams(json=PERSON), out[0].outputs[0].text) is not None


def test_sampled_completions_comply_and_differ(llm):
    so = {"json": PERSON}
    out = llm.generate(PROMPTS[:1], constrained(so, n=4, temperature=1.0, seed=3), use_tqdm=False)
    texts = [c.text for c in out[0].outputs]
    for c in out[0].outputs:
        assert c.structured_output == "valid", c.structured_output_error
        assert_complies(so, c.text)
    assert len(set(texts)) > 1  # the draws are not all the same


def test_cut_off_output_is_incomplete(llm):
    out = llm.generate(PROMPTS[:1], constrained({"json": PERSON}, max_tokens=3), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and c.structured_output == "incomplete"
    assert "before the constraint was complete" in c.structured_output_error


def test_logprobs_are_of_the_model_distribution(llm):
    """The sampled tokens obey the constraint; their reported alternatives are the model's own,
    so tokens the grammar forbade appear among them."""
    so = {"choice": ["ROMEO", "JULIET"]}
    out = llm.generate(PROMPTS[2:3], constrained(so, logprobs=5), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.text in so["choice"]
    first = c.logprobs[0]
    alternatives = [lp.decoded_token for lp in first.values()]
    assert any(not ("ROMEO".startswith(a) or "JULIET".startswith(a)) for a in alternatives)


def test_bad_constraints_are_request_errors(llm):
    cases = [
        ({"json": {"type": "strin"}}, "invalid_parameter", "not a valid JSON schema"),
        ({"json": {"type": "array", "uniqueItems": True}}, "unsupported_parameter", "uniqueItems"),
        ({"regex": "[a-"}, "invalid_parameter", "not a valid pattern"),
        ({"grammar": "root ::= ("}, "invalid_parameter", "structured_outputs.grammar"),
    ]
    for so, code, words in cases:
        with pytest.raises(RequestError) as e:
            llm.generate(["x"], constrained(so), use_tqdm=False)
        assert e.value.code == code and words in e.value.message, e.value.message
    for so in ({}, {"json": PERSON, "regex": "a"}, {"choice": []}, {"jsn": {}}):
        with pytest.raises(RequestError):
            StructuredOutputsParams.of(so)


def test_schema_error_names_its_path():
    so = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"minimum": "one"}}},
        source="body.response_format.json_schema.schema",
    )
    with pytest.raises(RequestError) as e:
        grammar_of(so)
    assert e.value.param == "response_format"
    assert "body.response_format.json_schema.schema.json" in e.value.message
    assert "properties/a/minimum" in e.value.message


def test_check_output():
    so = StructuredOutputsParams(json=PERSON)
    assert check_output(so, '{"name": "Al", "age": 3, "mood": "sad"}') is None
    assert "schema at age" in check_output(so, '{"name": "Al", "age": -3, "mood": "sad"}')
    assert "not JSON" in check_output(so, '{"name": ')
    assert check_output(StructuredOutputsParams(choice=["a", "b"]), "c") is not None
    assert check_output(StructuredOutputsParams(regex="a+"), "aab") is not None


def test_speculative_drafts_the_grammar_rejects_are_never_accepted():
    """n-gram drafts come from the prompt, which the constraint forbids; outputs equal those
    without speculation, and drafts were proposed (and some refused)."""
    kw = dict(dtype="float32", device="cpu", max_model_len=256)
    spec = LLM(**kw, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    plain = LLM(**kw)
    prompts = ['{"name": "ROMEO", "age": 12, "mood": "happy"} ROMEO: ROMEO: ROMEO:'] + PROMPTS
    for so in ({"json": PERSON}, {"regex": r"(ROMEO: ){1,3}[a-z]{1,8}"}):
        a = spec.generate(prompts, constrained(so), use_tqdm=False)
        b = plain.generate(prompts, constrained(so), use_tqdm=False)
        assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]
        assert all(o.outputs[0].structured_output == "valid" for o in a)
    assert spec.engine.stats.spec_proposed > 0


def test_preemption_and_chunked_prefill_keep_outputs():
    kw = dict(dtype="float32", device="cpu", max_model_len=256)
    # 96 tokens of KV (3 KiB a token): the rows preempt each other
    tight = LLM(**kw, block_size=4, kv_cache_memory=96 * 3072, max_num_batched_tokens=8)
    roomy = LLM(**kw)
    params = [constrained(so) for so in CONSTRAINTS] * 2
    prompts = [p * 2 for p in PROMPTS] * 2 + ["ROMEO:", "KING:"]
    a = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    b = roomy.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in a] == [o.outputs[0].text for o in b]


def test_batch_invariant_constrained_outputs_do_not_depend_on_batch():
    llm = LLM(dtype="float32", device="cpu", max_model_len=256, batch_invariant=True)
    params = [constrained(so) for so in CONSTRAINTS[:4]]
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    alone = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(PROMPTS, params)]
    assert [o.outputs[0].text for o in together] == [o.outputs[0].text for o in alone]


def test_compiled_grammars_are_cached(llm):
    grammars = llm.engine.grammars
    before = grammars.compiled
    so = {"json": {**PERSON, "title": "cache test"}}
    llm.generate(PROMPTS, constrained(so), use_tqdm=False)
    assert grammars.compiled == before + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_kernel_equals_reference(dtype):
    torch.manual_seed(0)
    vocab = 2053  # not a multiple of 32
    bits = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32)
    bits[1] = -1  # a row with every token allowed
    bits[2, ::2] = 0  # whole words refused
    x = torch.randn(5, vocab).to(dtype)
    ref = mask_rows_reference(x.clone(), bits)
    for row in range(5):
        for token in (0, 31, 32, 1000, vocab - 1):
            assert allowed(bits[row], token) == bool(ref[row, token] != float("-inf"))
    if not elementwise.use_mask_rows(x, bits):
        pytest.skip("the C kernels are not built here")
    assert torch.equal(elementwise.mask_rows(x, bits), ref)
