"""`profile advise` acceptance on ../shared/models/tinyshakespeare-5m (skipped with a message when
../shared is absent): a shared 400-token system prompt makes prefix caching the best TTFT trial;
long prompts the outputs copy from, one request at a time, get a TPOT trial advised as measured.
Each measurement is the best of 3 fresh-engine passes per request (advise's --repeat), so a
loaded machine slows a pass, not the result; the gains asserted are beyond the stated noise."""

from __future__ import annotations

import json

from llmctl.cli import main
from tests.conftest import shared_path


def _text() -> str:
    return shared_path("data/tinyshakespeare.txt").read_text()


def _advise(model, workload, out, *args):
    cmd = ["profile", "advise", str(model), "--workload", str(workload), "--report-json", str(out)]
    assert main(cmd + ["--device", "cpu", "-q", *args]) == 0
    record = json.loads(out.read_text())
    base = record["baseline"]
    gains = {}
    for tr in record["trials"]:
        if tr["measurement"]:
            key = "ttft_s" if record["settings"]["objective"] == "ttft" else "tpot_s"
            gains[tr["key"]] = base[key]["p50"] / tr["measurement"][key]["p50"]
    return record, gains


def test_shared_system_prompt_ranks_prefix_caching_first_on_ttft(shakespeare_model, tmp_path):
    text = _text()
    system = text[:1160]  # 405 tokens of this model's tokenizer
    rows = [{"prompt": system + text[5000 + 300 * i : 5040 + 300 * i]} for i in range(8)]
    workload = tmp_path / "prefix.jsonl"
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ("--objective", "ttft", "--max-tokens", "4", "--repeat", "3", "--confirm-rounds", "2")
    record, gains = _advise(shakespeare_model, workload, tmp_path / "r.json", *args)
    assert record["workload"]["shared_prefix_share"] > 0.8
    first = next(tr for tr in record["trials"] if tr["measurement"])
    noise = record["noise"]
    assert first["key"] == "prefix_caching", (gains, noise)
    assert gains["prefix_caching"] > max(1.3, 1 + noise), (gains, noise)
    assert "prefix_caching" in record["recommended"]
    assert "--no-prefix-caching" not in record["commands"][-1]
    # the printed command, in fresh processes against the baseline's, confirms a gain too
    confirmed = record["confirmed"]
    assert confirmed["gain"] > 1 + confirmed["noise"] and len(confirmed["rounds"]) == 2, confirmed


def test_copying_outputs_one_at_a_time_rank_the_tpot_trials(shakespeare_model, tmp_path):
    text = _text()
    rows = []
    for i in range(2):
        passage = text[20000 + 2000 * i : 20300 + 2000 * i]
        rows.append({"prompt": f"{passage}\n\n{passage}\n\n{passage[:40]}"})
    workload = tmp_path / "copy.jsonl"
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ("--objective", "tpot", "--concurrency", "1", "--max-tokens", "128", "--repeat", "3",
            "--confirm-rounds", "0")  # fmt: skip
    record, gains = _advise(shakespeare_model, workload, tmp_path / "r.json", *args)
    noise = record["noise"]
    # Measured on an AMD EPYC Zen 5 (2026-12-03), against the checkpoint's float32: bf16 2.6-4.0x
    # in a fresh process (its decode steps then ran as a flat decode program) but 1.25x late in the
    # full suite, n-gram speculation 0.93-1.32x: which leads depends on the machine and the
    # process, so this asserts that advise advises what it measured, not which trial wins.
    chosen = record["recommended"]
    assert chosen and all(gains[k] > 1 + noise for k in chosen), (gains, noise, chosen)
    assert gains[chosen[0]] == max(gains[k] for k in chosen)
    assert ("dtype_bfloat16" in chosen) == ("--dtype bfloat16" in record["commands"][-1])
    assert ("ngram" in chosen) == ("--speculative ngram" in record["commands"][-1])
    assert {"ngram", "dtype_bfloat16"} <= set(gains)  # both measured, not skipped
    skipped = {tr["key"]: tr["skipped"] for tr in record["trials"] if tr["skipped"]}
    assert "no shared prefixes" in skipped["prefix_caching"]
