"""`llmctl sparsify` end to end on tiny random models: output, report, errors, resume, recipes."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl.cli import main
from llmctl.compress.sparse.job import SparsifyArgs, run_sparsify
from llmctl.errors import UsageError
from llmctl.recipes.sparsify_recipe import load_recipe, merge_args
from llmctl.runtime.semi_structured import satisfies_nm
from tests.conftest import REPO, make_random_model

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama (no tokenizer) and a JSONL of token-id rows for calibration/eval."""
    root = tmp_path_factory.mktemp("sparse-cli")
    model = make_random_model(root / "model", "llama", seed=3)
    g = torch.Generator().manual_seed(0)
    rows = [
        {"prompt_token_ids": torch.randint(3, 160, (40,), generator=g).tolist()} for _ in range(30)
    ]
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, calib


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    "method,spec",
    [
        ("magnitude", ["--pattern", "2:4"]),
        ("wanda", ["--pattern", "4:8"]),
        ("sparsegpt", ["--pattern", "2:4"]),
    ],
)
def test_cli_prunes_every_group_and_writes_report(tiny, tmp_path, method, spec):
    model, calib = tiny
    out, report = tmp_path / "out", tmp_path / "r.json"
    rc = main(
        [
            "sparsify",
            str(model),
            "-o",
            str(out),
            "--method",
            method,
            *spec,
            "--calib",
            str(calib),
            "--num-samples",
            "8",
            "--seq-len",
            "32",
            "--report-json",
            str(report),
            "--quiet",
        ]
    )
    assert rc == 0
    n, m = (int(v) for v in spec[1].split(":"))
    w = _weights(out)
    for i in range(2):
        for rel in LINEARS:
            assert satisfies_nm(w[f"model.layers.{i}.{rel}.weight"], n, m), rel
    assert not satisfies_nm(w["lm_head.weight"], n, m)  # never pruned
    cfg = json.loads((out / "config.json").read_text())["sparsity_config"]
    assert cfg["pattern"] == spec[1] and cfg["method"] == method and len(cfg["layers"]) == 14
    r = json.loads(report.read_text())["sparsify"]
    assert r["global_sparsity"] == pytest.approx(1 - n / m)
    assert r["perplexity_before"] is not None and r["perplexity_after"] is not None
    assert all(line["pattern_ok"] for line in r["layers"])
    assert (r["calibration"] is None) == (method == "magnitude")
    assert "no speedup on the CPU" in r["speed_note"]
    assert (out / "recipe.yaml").is_file() and not (out / ".llmctl-work").exists()


def test_cli_unstructured_wanda_prunes_each_row(tiny, tmp_path):
    model, calib = tiny
    out = tmp_path / "out"
    assert (
        main(
            [
                "sparsify",
                str(model),
                "-o",
                str(out),
                "--sparsity",
                "0.25",
                "--method",
                "wanda",
                "--calib",
                str(calib),
                "--num-samples",
                "4",
                "--seq-len",
                "32",
                "--no-eval",
                "--quiet",
                "--ignore",
                "down_proj",
            ]
        )
        == 0
    )
    w = _weights(out)
    q = w["model.layers.1.self_attn.q_proj.weight"]  # [64, 64]: 16 zeros in every row
    assert ((q == 0).sum(1) == 16).all()
    assert int((w["model.layers.0.mlp.down_proj.weight"] == 0).sum()) == 0  # ignored
    cfg = json.loads((out / "config.json").read_text())["sparsity_config"]
    assert cfg["pattern"] == "unstructured-25%" and cfg["ignore"] == ["down_proj"]
    assert "model.layers.0.mlp.down_proj" not in cfg["layers"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--pattern", "2:4", "--sparsity", "0.5"], "not both"),
        (["--pattern", "3:2"], "0 < N < M"),
        (["--method", "obs"], "unknown --method"),
        (["--sparsity", "1.5"], "between 0 and 1"),
        (["--ignore", "*"], "no linear layer left"),
    ],
)
def test_cli_usage_errors_are_one_line(tiny, tmp_path, capsys, argv, needle):
    model, _ = tiny
    assert main(["sparsify", str(model), "-o", str(tmp_path / "o"), "--seq-len", "32", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_cli_refuses_non_empty_output(tiny, tmp_path, capsys):
    model, _ = tiny
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("keep me")
    assert main(["sparsify", str(model), "-o", str(tmp_path / "o"), "--method", "magnitude"]) == 2
    assert "not empty" in capsys.readouterr().err


def test_interrupted_run_resumes_from_last_layer(tiny, tmp_path):
    model, calib = tiny
    common = dict(
        model=str(model),
        pattern="2:4",
        method="sparsegpt",
        calib=str(calib),
        num_samples=6,
        seq_len=32,
        evaluate=False,
    )
    run_sparsify(SparsifyArgs(output=str(tmp_path / "whole"), **common))

    def stop_after_first(done, total):
        if done == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sparsify(
            SparsifyArgs(output=str(tmp_path / "resumed"), **common), progress=stop_after_first
        )
    assert (tmp_path / "resumed" / ".llmctl-work" / "resume" / "progress.json").is_file()
    report = run_sparsify(SparsifyArgs(output=str(tmp_path / "resumed"), **common))
    assert report.resumed_layers == 1
    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "resumed")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)


def test_recipe_values_and_flag_overrides(tmp_path):
    recipe = load_recipe(REPO / "recipes" / "sparse-2of4-gptq-w4.yaml")
    assert (
        recipe.sparsify["pattern"] == "2:4"
        and recipe.quantize["method"] == "gptq"
        and recipe.quantize["bits"] == 4
    )
    args = merge_args(
        recipe, {"model": "m", "output": "o", "method": None, "num_samples": 16, "sparsity": None}
    )
    assert (args.method, args.pattern, args.num_samples, args.seq_len) == (
        "sparsegpt",
        "2:4",
        16,
        512,
    )
    args = merge_args(recipe, {"model": "m", "output": "o", "sparsity": 0.6})
    assert (
        args.pattern is None and args.sparsity == 0.6
    )  # a flag replaces the recipe's pattern outright
    bad = tmp_path / "bad.yaml"
    for text, needle in (
        ("sparsify: {pattern: 2:4}", "quote the pattern"),
        ("sparsify: {metod: wanda}", "unknown key"),
        ("quantize: {bits: 4}", "needs a `sparsify`"),
        ("sparsify: {}\nextra: 1", "unknown section"),
    ):
        bad.write_text(text)
        with pytest.raises(UsageError, match=needle):
            load_recipe(bad)


def test_recipe_sparsify_then_gptq_keeps_every_zero(tiny, tmp_path):
    """2:4 SparseGPT then 4-bit GPTQ in one run; the packed output dequantizes to exact 2:4
    zeros."""
    from llmctl.runtime.formats import read_quantized

    model, calib = tiny
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        'sparsify: {method: sparsegpt, pattern: "2:4"}\n'
        "quantize: {method: gptq, bits: 4, group_size: 32, format: compressed-tensors}\n"
        "calibration: {num_samples: 8, seq_len: 32}\n"
    )
    out, report = tmp_path / "out", tmp_path / "r.json"
    assert (
        main(
            [
                "sparsify",
                str(model),
                "-o",
                str(out),
                "--recipe",
                str(recipe),
                "--calib",
                str(calib),
                "--report-json",
                str(report),
                "--quiet",
            ]
        )
        == 0
    )
    r = json.loads(report.read_text())
    assert r["zeros_kept_after_quantization"] is True
    assert r["quantize"]["method"] == "gptq" and r["quantize"]["perplexity_after"] is not None
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["sparsity_config"]["pattern"] == "2:4" and cfg["quantization_config"]
    _, linears, _ = read_quantized(out)
    assert len(linears) == 14
    for name, lin in linears.items():
        assert satisfies_nm(lin.dequantize(), 2, 4), name
    assert not (out / ".llmctl-work").exists()
    again = load_recipe(out / "recipe.yaml")  # the whole run, in recipe form
    assert (
        again.quantize["bits"] == 4
        and again.quantize["group_size"] == 32
        and again.sparsify["method"] == "sparsegpt"
    )


def test_output_recipe_reproduces_the_run(tiny, tmp_path):
    model, calib = tiny
    first = tmp_path / "first"
    assert (
        main(
            [
                "sparsify",
                str(model),
                "-o",
                str(first),
                "--method",
                "wanda",
                "--pattern",
                "4:8",
                "--calib",
                str(calib),
                "--num-samples",
                "5",
                "--seq-len",
                "24",
                "--ignore",
                "o_proj",
                "--no-eval",
                "--quiet",
            ]
        )
        == 0
    )
    recipe = load_recipe(first / "recipe.yaml")
    assert (
        recipe.sparsify["pattern"] == "4:8"
        and recipe.calibration["num_samples"] == 5
        and recipe.quantize is None
    )
    second = tmp_path / "second"
    assert (
        main(
            [
                "sparsify",
                str(model),
                "-o",
                str(second),
                "--recipe",
                str(first / "recipe.yaml"),
                "--no-eval",
                "--quiet",
            ]
        )
        == 0
    )
    a, b = _weights(first), _weights(second)
    assert all(torch.equal(a[k], b[k]) for k in a)
