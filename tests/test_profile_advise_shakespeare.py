"""`profile advise` acceptance on ../shared/models/tinyshakespeare-5m (skipped with a message when
../shared is absent): a shared 400-token system prompt makes prefix caching the best TTFT trial;
long prompts the outputs copy from, one request at a time, rank the TPOT trials (bf16 first).
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
    # (its decode steps run as models/decode_program.py), n-gram speculation 0.93-1.29x (it paid
    # 1.40x before bf16 decode got its program; in bf16 it now loses, 0.69-0.73x), so advise
    # leads with bf16 and measures n-gram with the rest.
    assert gains["dtype_bfloat16"] > max(1.5, 1 + noise), (gains, noise)
    assert record["recommended"][0] == "dtype_bfloat16"
    assert "--dtype bfloat16" in record["commands"][-1]
    assert "ngram" in gains  # measured, not skipped
    if "ngram" in record["recommended"]:
        assert "--speculative ngram" in record["commands"][-1]
    skipped = {tr["key"]: tr["skipped"] for tr in record["trials"] if tr["skipped"]}
    assert "no shared prefixes" in skipped["prefix_caching"]
