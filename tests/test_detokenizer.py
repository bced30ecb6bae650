"""Incremental output text: equal to decoding the whole output, stop strings found at the same
token as a full re-decode would find them, and a decode window that does not grow with length."""

import random

import pytest

from llmctl.engine.detokenizer import IncrementalText, first_stop
from llmctl.engine.params import SamplingParams
from llmctl.llm import LLM
from llmctl.runtime.resolve import DEMO_MODEL_DIR
from llmctl.runtime.tokenizer import load_tokenizer


def byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def test_multibyte_characters_split_over_tokens_are_held_back():
    ids = list("a€b😀".encode())  # 1 + 3 + 1 + 4 bytes, one token each
    text, seen = IncrementalText(), []
    for n in range(1, len(ids) + 1):
        text.update(byte_decode, ids[:n])
        seen.append(text.text)
        assert "\ufffd" not in text.text
    assert text.text == "a€b😀"
    assert seen[:4] == ["a", "a", "a", "a€"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_MODEL_DIR)


def test_incremental_text_equals_full_decode(tokenizer):
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        text = IncrementalText()
        for n in range(1, len(ids) + 1):
            text.update(decode, ids[:n])
        assert text.text == decode(ids)


def test_first_stop_looks_only_at_matches_ending_in_new_text():
    assert first_stop("abc STOP def", ["STOP"]) == 4
    assert first_stop("abc STOP def", ["STOP"], since=9) is None  # ended before the new text
    assert first_stop("abc STO", ["STOP"], since=6) is None
    assert first_stop("abc STOP", ["STOP"], since=7) == 4  # the last letter is new
    assert first_stop("xxab", ["b", "xab"], since=3) == 1  # the earliest start wins


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", device="cpu", kv_cache_memory=16 * 1024**2)


def test_engine_decodes_a_short_window_per_step_and_stops_where_a_full_decode_would(llm):
    greedy = llm.generate(["ROMEO:"], SamplingParams(max_tokens=120, temperature=0))[0]
    stop_word = greedy.text.split()[-3]
    engine = llm.engine
    full, windows = engine.detokenize, []

    def counting(ids):
        windows.append(len(ids))
        return full(ids)

    engine.detokenize = counting
    try:
        out = llm.generate(
            ["ROMEO:"], SamplingParams(max_tokens=120, temperature=0, stop=[stop_word, "\x00never"])
        )[0]
    finally:
        engine.detokenize = full
    ids = greedy.output_token_ids
    first = next(n for n in range(1, len(ids) + 1) if stop_word in full(ids[:n]))  # the old rule
    assert out.finish_reason == "stop" and out.output_token_ids == ids[:first]
    assert out.text == full(ids[:first])[: full(ids[:first]).find(stop_word)]
    assert first > 40 and max(windows[:-1]) <= 8  # the last call decodes the whole output once
