"""`llmctl eval` and llmctl.runtime.evaluate: which tokens are scored, exact values on toy models,
and agreement with a direct transformers computation on tinyshakespeare-5m."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llmctl.cli import main
from llmctl.errors import UsageError
from llmctl.runtime.evaluate import perplexity, plan_windows


@pytest.fixture(autouse=True)
def one_thread():
    """Multi-threaded CPU GEMMs crawl when the test machine's cores are oversubscribed; one thread
    is steady."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TableModel(torch.nn.Module):
    """Logits depend only on the previous token: row `logits[prev]` (fixed), so every quantity is
    computable by hand."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)  # [V, V]

    def forward_dense(self, ids: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, V]
        return self.table[ids]


@pytest.mark.parametrize(
    "n,seq_len,stride", [(100, 16, 8), (100, 16, 16), (17, 16, 5), (5, 16, 8), (64, 16, 1)]
)
def test_windows_score_each_token_once(n, seq_len, stride):
    windows = plan_windows(n, seq_len, stride)
    scored = [t for w in windows for t in range(w.score_from, w.end)]
    assert len(scored) == len(set(scored))
    assert windows[-1].end == n and windows[0].begin == 0
    for w in windows:
        assert w.end - w.begin <= seq_len and w.begin < w.score_from
    if stride < seq_len:
        assert scored == list(range(1, n))
    else:  # non-overlapping windows: each window's first token has no context: skipped, as in HF
        assert set(range(1, n)) - set(scored) == {w.begin for w in windows[1:]}


def test_window_arguments_are_checked():
    for args in ((100, 1, 1), (100, 16, 0), (100, 16, 17), (1, 16, 8)):
        with pytest.raises(UsageError):
            plan_windows(*args)


def test_perplexity_and_kl_by_hand():
    torch.manual_seed(0)
    v = 7
    model, ref = TableModel(torch.randn(v, v)), TableModel(torch.randn(v, v))
    ids = torch.randint(0, v, (40,)).tolist()
    logp, ref_logp = torch.log_softmax(model.table, -1), torch.log_softmax(ref.table, -1)
    # the previous token alone decides the prediction, so every scored token (1..39) counts once
    nll = -sum(logp[ids[t - 1], ids[t]].item() for t in range(1, 40)) / 39
    kl = (
        sum(
            (ref_logp[ids[t - 1]].exp() * (ref_logp[ids[t - 1]] - logp[ids[t - 1]])).sum().item()
            for t in range(1, 40)
        )
        / 39
    )
    r = perplexity(model, ids, seq_len=8, stride=3, reference=ref)
    assert r.num_scored_tokens == 39 and r.num_tokens == 40
    assert r.perplexity == pytest.approx(math.exp(nll), rel=1e-5)
    assert r.mean_kl == pytest.approx(kl, rel=1e-5) and r.mean_kl > 0
    assert perplexity(model, ids, 8, reference=model).mean_kl == pytest.approx(0.0, abs=1e-6)
    uniform = TableModel(torch.zeros(v, v))
    assert perplexity(uniform, ids, 8).perplexity == pytest.approx(v)


def test_batched_windows_equal_one_at_a_time(monkeypatch):
    from llmctl.runtime import evaluate

    torch.manual_seed(1)
    model, ref = TableModel(torch.randn(11, 11)), TableModel(torch.randn(11, 11))
    ids = torch.randint(0, 11, (203,)).tolist()
    batched = perplexity(model, ids, 16, 5, reference=ref)
    monkeypatch.setattr(evaluate, "LOGITS_BUDGET", 1)  # one window per forward pass
    single = perplexity(model, ids, 16, 5, reference=ref)
    assert batched.num_windows == single.num_windows > 30
    assert batched.perplexity == pytest.approx(single.perplexity, rel=1e-6)
    assert batched.mean_kl == pytest.approx(single.mean_kl, rel=1e-6)


def _hf_strided_perplexity(hf_model, ids: torch.Tensor, seq_len: int, stride: int) -> float:
    """Hugging Face's documented strided-perplexity loop, weighting each window's mean loss by the
    labels it really scores (after transformers' internal shift)."""
    n = ids.size(1)
    nll_sum, count, prev_end = 0.0, 0, 0
    for begin in range(0, n, stride):
        end = min(begin + seq_len, n)
        target_len = end - prev_end
        inputs = ids[:, begin:end]
        labels = inputs.clone()
        labels[:, :-target_len] = -100
        with torch.no_grad():
            loss = hf_model(inputs, labels=labels).loss
        scored = (labels[:, 1:] != -100).sum().item()
        nll_sum += loss.item() * scored
        count += scored
        prev_end = end
        if end == n:
            break
    return math.exp(nll_sum / count)


def test_matches_transformers_on_tinyshakespeare(shakespeare_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmctl.runtime.weights import load_model
    from tests.conftest import shared_path

    text = shared_path("data/tinyshakespeare.txt").read_text()[-1500:]  # held-out tail
    ids = AutoTokenizer.from_pretrained(str(shakespeare_model))(
        text, return_tensors="pt"
    ).input_ids  # [1, N]
    hf = AutoModelForCausalLM.from_pretrained(str(shakespeare_model), dtype=torch.float32).eval()
    ours, _ = load_model(shakespeare_model, "float32", "cpu")
    for seq_len, stride in ((96, 48), (64, 64)):
        expected = _hf_strided_perplexity(hf, ids, seq_len, stride)
        got = perplexity(ours, ids[0].tolist(), seq_len, stride).perplexity
        assert got == pytest.approx(expected, rel=1e-4)
    assert 5 < expected < 500  # a trained model, not noise


def test_cli_eval_text_and_jsonl(tmp_path, capsys, shakespeare_model):
    text = (
        "ROMEO:\nBut soft, what light through yonder window breaks?\n"
        "It is the east, and Juliet is the sun.\n" * 3
    )
    plain = tmp_path / "d.txt"
    plain.write_text(text)
    rows = tmp_path / "d.jsonl"
    rows.write_text("\n".join(json.dumps({"text": t}) for t in text.split("\n\n")) + "\n")
    args = [
        str(shakespeare_model),
        "--seq-len",
        "32",
        "--stride",
        "16",
        "--dtype",
        "float32",
        "--report-json",
        "-",
        "-q",
    ]
    assert main(["eval", *args, "--data", str(plain), "--reference", str(shakespeare_model)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["schema"] == "llmctl.eval" and record["schema_version"] == 1
    result = record["result"]
    assert result["num_scored_tokens"] == result["num_tokens"] - 1
    assert 1 < result["perplexity"] < 2048 and result["mean_kl"] == pytest.approx(0, abs=1e-6)
    assert result["reference_perplexity"] == pytest.approx(result["perplexity"], rel=1e-6)
    assert record["environment"]["dtype"] == "float32" and "strided" in record["method"]
    assert main(["eval", *args, "--data", str(rows), "--max-tokens", "20"]) == 0
    limited = json.loads(capsys.readouterr().out)["result"]
    assert (
        limited["num_tokens"] == 20
        and limited["num_scored_tokens"] == 19
        and limited["mean_kl"] is None
    )


def test_cli_eval_errors(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    assert main(["eval", "--data", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(["eval", "--data", str(tmp_path / "missing.txt")]) == 2
    small = tmp_path / "s.txt"
    small.write_text("hello there, friends of Rome")
    assert main(["eval", "--data", str(small), "--seq-len", "100000"]) == 2
    assert "exceeds the model's context" in capsys.readouterr().err
    assert main(["eval", "--data", str(small), "--seq-len", "16", "--stride", "32"]) == 2


def test_cli_eval_old_json_switch_still_prints_json(tmp_path, capsys):
    small = tmp_path / "s.txt"
    small.write_text("hello there, friends of Rome. " * 8)
    argv = ["eval", "--data", str(small), "--seq-len", "16", "--max-tokens", "24", "-q"]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert "--json is deprecated; use --report-json -" in captured.err
    assert json.loads(captured.out)["schema"] == "llmctl.eval"  # only the JSON on stdout
    assert main(argv) == 0
    assert "perplexity" in capsys.readouterr().out  # the table without JSON
    out = tmp_path / "e.json"
    assert main([*argv, "--report-json", str(out)]) == 0
    assert "perplexity" in capsys.readouterr().out and json.loads(out.read_text())["result"]
    assert main([*argv, "--json", "--report-json", str(out)]) == 2
