"""distill's training data: records, loss masks, packing, streaming over epochs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmctl.errors import UsageError
from llmctl.runtime.resolve import DEMO_MODEL_DIR
from llmctl.runtime.tokenizer import load_tokenizer
from llmctl.train.data import SequenceStream, Tokenize, count_sequences, packed, token_records

EOS = 0


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEMO_MODEL_DIR)


def jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_completion_trains_on_the_completion_only(tok, tmp_path):
    f = jsonl(tmp_path / "d.jsonl", [{"prompt": "To be or", "completion": " not to be"}])
    [(ids, mask)] = list(token_records(f, Tokenize(tok, EOS)))
    prompt = tok("To be or")["input_ids"]
    completion = tok(" not to be", add_special_tokens=False)["input_ids"]
    assert ids == prompt + completion + [EOS]
    assert mask == [0] * len(prompt) + [1] * (len(completion) + 1)


def test_messages_train_on_the_assistant_tokens_only(tok, tmp_path):
    msgs = [
        {"role": "user", "content": "Who goes there"},
        {"role": "assistant", "content": "A friend"},
        {"role": "user", "content": "Stand"},
        {"role": "assistant", "content": "I stand"},
    ]
    f = jsonl(tmp_path / "d.jsonl", [{"messages": msgs}])
    [(ids, mask)] = list(token_records(f, Tokenize(tok, EOS)))
    targets = tok.decode([i for i, m in zip(ids, mask) if m])
    others = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "A friend" in targets and "I stand" in targets
    assert "Who goes" not in targets and "Stand" not in targets.replace("stand", "")
    assert "Who goes there" in others and "ASSISTANT" in others


def test_text_rows_and_parquet_give_the_same_records(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": "First citizen speaks."}, {"text": "Second citizen answers."}]
    f = jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    t = Tokenize(tok, EOS)
    a = list(token_records(f, t))
    assert a == list(token_records(tmp_path / "d.parquet", t))
    assert a[0][0][-1] == EOS and all(a[0][1])


def test_packing_cuts_the_joined_stream_into_fixed_sequences(tok, tmp_path):
    text = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n" * 20
    f = tmp_path / "d.txt"
    f.write_text(text)
    t = Tokenize(tok, EOS)
    stream = tok(text, add_special_tokens=False)["input_ids"]
    seqs = list(packed(f, t, 16))
    assert len(seqs) == len(stream) // 16 == count_sequences(f, t, 16)
    assert torch.equal(torch.cat([s.ids for s in seqs]), torch.tensor(stream[: len(seqs) * 16]))
    assert all(s.mask.all() for s in seqs)


def test_stream_repeats_epochs_and_skips_to_a_position(tok, tmp_path):
    f = tmp_path / "d.txt"
    f.write_text("one two three four five six seven eight nine ten\n" * 8)
    t = Tokenize(tok, EOS)
    wraps = []
    s = SequenceStream(f, t, 8, limit=3, on_wrap=wraps.append)
    first = [s.next().ids for _ in range(7)]
    assert wraps == [3] and s.position == 7
    assert torch.equal(first[0], first[3]) and torch.equal(first[1], first[4])
    resumed = SequenceStream(f, t, 8, limit=3)
    resumed.skip(5)
    assert torch.equal(resumed.next().ids, first[5])


def test_bad_rows_are_one_line_errors_naming_the_row(tok, tmp_path):
    t = Tokenize(tok, EOS)
    for row, words in (
        ({"prompt": "only a prompt"}, "both be strings"),
        ({"other": 1}, "no usable field"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role"),
    ):
        f = jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, row])
        with pytest.raises(UsageError, match=words) as e:
            list(token_records(f, t))
        assert str(e.value).startswith("d.jsonl:2") and "\n" not in str(e.value)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(UsageError, match="bad.jsonl:1: invalid JSON"):
        list(token_records(tmp_path / "bad.jsonl", t))
