"""run-batch rows asking for logprobs, prompt_logprobs and n > 1, in the simple, OpenAI chat and
OpenAI completions shapes (the embedded demo model, float32, CPU); the values are the Python
API's (tests/test_logprobs.py checks those against transformers)."""

from __future__ import annotations

import json

import pytest

from llmctl import LLM, SamplingParams
from llmctl.batch.options import BatchOptions, fingerprint
from llmctl.cli import main

ARGS = ["--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "16MiB", "-q"]
ARGS += ["--max-tokens", "5"]
OLD_KEYS = {"id", "text", "finish_reason", "usage", "error"}


def run(tmp_path, rows, *extra, out="out.jsonl"):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dst = tmp_path / out
    assert main(["run-batch", str(src), "-o", str(dst), *ARGS, *extra]) == 0
    if out.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(dst)
    return [json.loads(line) for line in dst.read_text().splitlines()]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", device="cpu", kv_cache_memory=16 << 20)


def test_simple_rows(tmp_path, llm):
    rows = [
        {"prompt": "ROMEO:", "logprobs": 2, "prompt_logprobs": 1},
        {"prompt": "JULIET:", "n": 3, "temperature": 1.0, "seed": 5},
        {"prompt": "ROMEO:"},
    ]
    scored, many, plain = run(tmp_path, rows)
    ref = llm.generate("ROMEO:", SamplingParams(max_tokens=5, temperature=0, logprobs=2))[0]
    got = scored["logprobs"]
    assert [e["token_id"] for e in got] == ref.outputs[0].token_ids
    for e, pos in zip(got, ref.outputs[0].logprobs):
        assert e["logprob"] == pos[e["token_id"]].logprob and e["rank"] >= 1
        assert [t["token_id"] for t in e["top_logprobs"]] == [
            t for t, lp in sorted(pos.items(), key=lambda tv: tv[1].rank) if lp.rank <= 2
        ][:2]
        assert e["token"] == llm.runtime.decode([e["token_id"]])
    prompt = scored["prompt_logprobs"]
    assert len(prompt) == scored["usage"]["prompt_tokens"] and prompt[0] is None
    assert all(len(p["top_logprobs"]) == 1 for p in prompt[1:])
    assert set(plain) == OLD_KEYS and "logprobs" not in many

    sp = SamplingParams(max_tokens=5, temperature=1.0, seed=5, n=3)
    want = llm.generate("JULIET:", sp)[0]
    outs = many["outputs"]
    assert [o["index"] for o in outs] == [0, 1, 2]
    assert [o["text"] for o in outs] == [c.text for c in want.outputs]
    assert many["text"] == outs[0]["text"] and many["finish_reason"] == outs[0]["finish_reason"]
    completion = sum(len(c.token_ids) for c in want.outputs)
    assert many["usage"]["completion_tokens"] == completion


def openai(cid, url, **body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def test_openai_shapes(tmp_path):
    chat_msgs = [{"role": "user", "content": "Who art thou?"}]
    rows = [
        openai("c", "/v1/chat/completions", messages=chat_msgs, logprobs=True, top_logprobs=2, n=2),
        openai("p", "/v1/completions", prompt="ROMEO:", logprobs=3, prompt_logprobs=1),
        openai("q", "/v1/chat/completions", messages=chat_msgs, prompt_logprobs=0),
        openai("x", "/v1/chat/completions", messages=chat_msgs, top_logprobs=2),
        openai("y", "/v1/completions", prompt="ROMEO:", logprobs=True),
    ]
    chat, comp, chat_prompt, bad_chat, bad_comp = run(tmp_path, rows)
    body = chat["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    lengths = [len(c["logprobs"]["content"]) for c in body["choices"]]
    assert body["usage"]["completion_tokens"] == sum(lengths)
    content = body["choices"][0]["logprobs"]["content"]
    assert body["choices"][0]["logprobs"]["refusal"] is None
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert content[0]["top_logprobs"][0]["logprob"] >= content[0]["top_logprobs"][1]["logprob"]

    choice = comp["response"]["body"]["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 5
    assert all(3 <= len(t) <= 4 for t in lp["top_logprobs"])  # top 3, and the sampled token
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    prompt_lps = choice["prompt_logprobs"]
    assert (
        prompt_lps[0] is None
        and len(prompt_lps) == comp["response"]["body"]["usage"]["prompt_tokens"]
    )
    first = next(iter(prompt_lps[1].values()))
    assert set(first) == {"logprob", "rank", "decoded_token"}

    cp = chat_prompt["response"]["body"]
    assert cp["prompt_logprobs"][0] is None and cp["choices"][0]["logprobs"] is None
    for bad, param in ((bad_chat, "top_logprobs"), (bad_comp, "logprobs")):
        err = bad["response"]["body"]["error"]
        assert bad["response"]["status_code"] == 400 and err["param"] == param


def test_logprobs_flag_and_parquet_columns(tmp_path):
    rows = [{"prompt": "ROMEO:"}, {"prompt": "JULIET:", "n": 2, "temperature": 1.0, "seed": 1}]
    table = run(tmp_path, rows, "--logprobs", "1", out="out.parquet")
    assert {"logprobs", "outputs"} <= set(table.column_names)
    data = table.to_pylist()
    assert len(data[0]["logprobs"]) == 5 and len(data[0]["logprobs"][0]["top_logprobs"]) == 1
    assert len(data[1]["outputs"]) == 2 and len(data[1]["outputs"][1]["logprobs"]) == 5
    plain = run(tmp_path, [{"prompt": "a"}], out="plain.parquet")
    assert set(plain.column_names) == OLD_KEYS


def test_parquet_input_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "in.parquet"
    table = {"prompt": ["ROMEO:", "JULIET:"], "n": [2.0, None], "logprobs": [None, 1.0]}
    pq.write_table(pa.table(table), src)  # float columns, as pandas writes ints with nulls
    dst = tmp_path / "out.jsonl"
    assert main(["run-batch", str(src), "-o", str(dst), *ARGS]) == 0
    first, second = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(first["outputs"]) == 2 and "logprobs" not in first
    assert len(second["logprobs"]) == second["usage"]["completion_tokens"]


def test_the_fingerprint_of_a_job_without_them_is_unchanged(tmp_path):
    from llmctl.batch.options import default_sampling

    src = tmp_path / "in.jsonl"
    src.write_text("{}\n")
    opts = BatchOptions(input=str(src))
    fp = fingerprint(opts, "simple", default_sampling(opts))
    assert not {"sampling.n", "sampling.logprobs", "sampling.prompt_logprobs"} & set(fp)
    opts = BatchOptions(input=str(src), sampling={"logprobs": 2})
    assert fingerprint(opts, "simple", default_sampling(opts))["sampling.logprobs"] == 2
