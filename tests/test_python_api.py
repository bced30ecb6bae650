"""The Python API's vLLM surface: prompt forms, chat of one or many conversations, vLLM's engine
keywords, SamplingParams conventions (the embedded demo model, float32, CPU)."""

from __future__ import annotations

import pytest

from llmctl import LLM, SamplingParams, TokensPrompt
from llmctl.errors import RequestError, UsageError
from llmctl.llm import engine_fields

GREEDY = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture(scope="module")
def llm():
    return LLM(
        dtype="float32",
        device="cpu",
        max_num_seqs=4,  # with max_model_len: a small KV cache
        enforce_eager=True,
        gpu_memory_utilization=0.9,  # ignored on the CPU
        max_model_len=128,
    )


def test_every_prompt_form_gives_the_same_answer(llm):
    ids = llm.runtime.encode("ROMEO:")
    forms = ["ROMEO:", ids, {"prompt": "ROMEO:"}, TokensPrompt(prompt_token_ids=ids)]
    outs = llm.generate(forms, sampling_params=GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == ["ROMEO:", None, "ROMEO:", None]
    assert all(o.prompt_token_ids == ids for o in outs)
    (one,) = llm.generate({"prompt_token_ids": ids}, GREEDY)  # a single dict prompt
    assert one.outputs[0].token_ids == outs[0].output_token_ids
    assert llm.generate(ids, params=GREEDY)[0].text == outs[0].outputs[0].text  # older keyword
    assert llm.engine.max_model_len == 128 and llm.engine.engine_config.cuda_graphs is False


def test_bad_prompts_are_one_line_request_errors(llm):
    for bad, words in (
        ({"prompt_tokens": [1]}, "not supported"),
        ({"prompt": 5}, "needs 'prompt'"),
        (3.5, "a prompt is text"),
    ):
        with pytest.raises(RequestError, match=words) as e:
            llm.generate([bad], GREEDY)
        assert "\n" not in str(e.value)
    with pytest.raises(UsageError):
        llm.generate(["a", "b"], [GREEDY])


def test_chat_takes_one_conversation_or_a_list(llm):
    conv = [{"role": "user", "content": "Who art thou?"}]
    (one,) = llm.chat(conv, GREEDY, use_tqdm=False)
    two = llm.chat([conv, conv], sampling_params=GREEDY)
    assert len(two) == 2 and all(o.output_token_ids == one.output_token_ids for o in two)
    assert one.prompt_token_ids == llm.runtime.apply_chat_template(conv)
    assert one.prompt and llm.get_tokenizer() is llm.runtime.tokenizer


def test_top_k_minus_one_and_zero_mean_no_cut():
    assert SamplingParams(top_k=-1).top_k is None and SamplingParams(top_k=0).top_k is None
    with pytest.raises(RequestError):
        SamplingParams(top_k=-2)


def test_vllm_engine_keywords():
    # vLLM's speculative_config is read by the same parser as --speculative-config
    assert engine_fields(False, None, {"method": "ngram", "num_speculative_tokens": 3}, 1, {}) == {
        "speculative": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 5,
        "prompt_lookup_min": 5,
    }
    for bad in ({"method": "eagle", "model": "x"}, {"method": "ngram", "frobnicate": 1}, "[1]"):
        with pytest.raises(UsageError):
            engine_fields(False, None, bad, 1, {})
    assert engine_fields(True, None, None, 1, {"block_size": 8}) == {
        "block_size": 8,
        "cuda_graphs": False,
    }
    for args in ((False, None, None, 2, {}),):
        with pytest.raises(UsageError):
            engine_fields(*args)
    with pytest.raises(UsageError):  # checked by EngineConfig, as for --gpu-memory-utilization
        LLM(None, gpu_memory_utilization=1.5)
