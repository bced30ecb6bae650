"""quantize/sparsify options: every bad value is one line, exit 2, before the model loads (nothing
created); the shared --group-size rule (auto on the demo model, per channel, profile --estimate);
a recipe's later stage checked before pruning; --ignore warnings; calibration data errors; and
every --help example run on the embedded model."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import torch

from llmctl.cli import main
from llmctl.commands import quantize as quantize_cmd
from llmctl.commands import sparsify as sparsify_cmd
from llmctl.errors import UsageError
from llmctl.runtime.formats.spec import parse_group_size, resolve_group_size
from llmctl.runtime.resolve import DEMO_MODEL_DIR
from llmctl.runtime.weights import load_model
from tests.conftest import REPO, make_random_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("compress-opt")
    model = make_random_model(root / "model", "llama", seed=7)  # widths 64 and 96, context 256
    g = torch.Generator().manual_seed(0)
    rows = [
        {"prompt_token_ids": torch.randint(3, 160, (40,), generator=g).tolist()} for _ in range(20)
    ]
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, calib


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a job gets as far as loading the model."""
    import llmctl.runtime.loader as loader

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(loader, "load_runtime", refuse)


def _quantize(model, out, *argv):
    return main(["quantize", str(model), "-o", str(out), *argv, "--quiet"])


def _one_line_error(capsys, needle):
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("llmctl: error:"), err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--group-size", "0"], "--group-size takes auto, channel, or a power of two"),
        (["--group-size", "48"], "--group-size takes"),
        (["--group-size", "-1"], "--group-size takes"),
        (
            ["--group-size", "64"],
            "down_proj: 96 input features are not a multiple of --group-size 64",
        ),
        (["--bits", "5"], "--bits must be 2, 3, 4 or 8"),
        (["--format", "awq", "--bits", "8"], "--format awq stores 4-bit weights only"),
        (["--format", "awq", "--group-size", "channel"], "--format awq stores groups only"),
        (["--num-samples", "0"], "--num-samples must be at least 1"),
        (["--seq-len", "1"], "--seq-len must be at least 2"),
        (["--dampening", "0"], "--dampening must be between 0 and 1"),
        (["--ignore", "re:(["], "invalid regular expression"),
        (["--ignore", "*"], "--ignore leaves no layer to quantize"),
        (["--calib", "missing.jsonl"], "--calib missing.jsonl not found"),
        (["--eval-data", "missing.txt"], "--eval-data missing.txt not found"),
        (["--report-json", "no/such/dir/r.json"], "folder no/such/dir does not exist"),
        (["--report-json", "."], "--report-json . is a folder"),
        (["--device", "tpu"], "unknown --device"),
    ],
)
def test_quantize_refuses_bad_options_before_loading(
    tiny, tmp_path, capsys, no_loading, argv, needle
):
    model, calib = tiny
    out = tmp_path / "out"
    assert _quantize(model, out, "--rtn", "--calib", str(calib), *argv) == 2
    _one_line_error(capsys, needle)
    assert not out.exists()


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--column-block", "0"], "--column-block must be a positive number"),
        (["--block-size", "0"], "--column-block must be a positive number"),  # the old name
        (["--pattern", "2:3"], "--pattern 2:3 is not allowed: N:M needs 0 < N < M and M a power"),
        (["--pattern", "4:256"], "--pattern 4:256 is not allowed"),
        (
            ["--pattern", "2:4", "--column-block", "2"],
            "--column-block 2 must be a multiple of the pattern's group width 4",
        ),
        (["--num-samples", "0"], "--num-samples must be at least 1"),
        (["--report-json", "no/such/dir/r.json"], "folder no/such/dir does not exist"),
        (["--ignore", "*"], "no linear layer left to prune"),
    ],
)
def test_sparsify_refuses_bad_options_before_loading(
    tiny, tmp_path, capsys, no_loading, argv, needle
):
    model, calib = tiny
    out = tmp_path / "out"
    assert (
        main(
            [
                "sparsify",
                str(model),
                "-o",
                str(out),
                "--calib",
                str(calib),
                "--seq-len",
                "32",
                *argv,
                "--quiet",
            ]
        )
        == 2
    )
    _one_line_error(capsys, needle)
    assert not out.exists()


@pytest.mark.parametrize(
    "quantize_section,needle",
    [
        ("{method: gptq, group_size: 0}", "--group-size takes"),
        (
            "{method: gptq, group_size: 64}",
            "96 input features are not a multiple of --group-size 64",
        ),
        ("{method: gptq, bits: 5}", "recipe quantize.bits: must be 2, 3, 4 or 8, got 5"),
        ("{method: gptq, format: awq, bits: 8}", "--format awq stores 4-bit weights only"),
        ("{method: obs}", "unknown method"),
        ("{method: gptq, ignore: lm_head}", "recipe quantize.ignore: must be a list of strings"),
        ("{method: gptq, act_order: 1}", "recipe quantize.act_order: must be true or false"),
    ],
)
def test_a_recipe_with_a_bad_later_stage_is_refused_before_pruning(
    tiny, tmp_path, capsys, no_loading, quantize_section, needle
):
    model, calib = tiny
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f'sparsify: {{method: sparsegpt, pattern: "2:4"}}\nquantize: {quantize_section}\n'
    )
    out = tmp_path / "out"
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
                "--seq-len",
                "32",
                "--quiet",
            ]
        )
        == 2
    )
    _one_line_error(capsys, needle)
    assert not out.exists()


def test_recipe_value_types_are_checked(tmp_path):
    from llmctl.recipes.sparsify_recipe import load_recipe

    for text, needle in (
        (
            "calibration: {num_samples: '8'}\nsparsify: {}",
            "recipe calibration.num_samples: must be an integer",
        ),
        ("sparsify: {block_size: true}", "recipe sparsify.block_size: must be an integer"),
        ("sparsify: {sparsity: yes}", "recipe sparsify.sparsity: must be a number"),
    ):
        (tmp_path / "r.yaml").write_text(text)
        with pytest.raises(UsageError, match=re.escape(needle)):
            load_recipe(tmp_path / "r.yaml")


def test_group_size_rule_is_one_rule():
    widths = [("a", 256), ("mlp.down_proj", 704)]  # the demo model's widths
    size, note = resolve_group_size("auto", widths)
    assert size == 64 and "704" in note
    assert resolve_group_size("auto", [("a", 4096), ("b", 11008)]) == (128, None)
    assert resolve_group_size("auto", [("a", 100)])[0] is None  # per channel when nothing fits
    with pytest.raises(UsageError, match="--format awq"):
        resolve_group_size("auto", [("a", 100)], channel_format="awq")
    assert resolve_group_size("channel", widths) == (None, None)
    assert parse_group_size(" 256 ") == 256
    for bad in (0, -1, 7, 48, 100, "x", True, "16.0"):
        with pytest.raises(UsageError, match="--group-size takes"):
            parse_group_size(bad)


@pytest.mark.parametrize("size", ["0", "48", "7"])
def test_profile_estimate_refuses_the_group_sizes_quantize_refuses(capsys, size):
    assert (
        main(
            ["profile", "--estimate", str(DEMO_MODEL_DIR), "--dtype", "int4", "--group-size", size]
        )
        == 2
    )
    _one_line_error(capsys, "--group-size takes")


def test_profile_estimate_resolves_auto_like_quantize(tmp_path):
    record = tmp_path / "e.json"
    assert (
        main(
            [
                "profile",
                "--estimate",
                str(DEMO_MODEL_DIR),
                "--dtype",
                "int4",
                "--report-json",
                str(record),
            ]
        )
        == 0
    )
    r = json.loads(record.read_text())
    assert r["estimate"]["group_size"] == 64 and "704" in r["group_size_note"]
    assert (
        main(
            ["profile", "--estimate", str(DEMO_MODEL_DIR), "--dtype", "int4", "--group-size", "128"]
        )
        == 2
    )


def test_default_group_size_works_on_the_demo_model_and_says_so(tmp_path):
    out, report = tmp_path / "q", tmp_path / "r.json"
    assert (
        _quantize(
            DEMO_MODEL_DIR,
            out,
            "--rtn",
            "--num-samples",
            "2",
            "--seq-len",
            "32",
            "--report-json",
            str(report),
        )
        == 0
    )
    r = json.loads(report.read_text())
    assert r["group_size"] == 64
    assert "128 does not divide the 704 input columns" in r["group_size_note"]
    assert r["group_size_note"] in r["warnings"]
    recipe = (out / "recipe.yaml").read_text()
    assert "group_size: 64" in recipe and "# --group-size auto chose 64" in recipe
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["config_groups"]["group_0"]["weights"]["group_size"] == 64
    model, _ = load_model(out, "float32", "cpu")  # our loader takes it
    assert model.model.layers[0].mlp.down_proj.group_size == 64


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq"])
def test_per_channel_checkpoints_load_here_and_in_transformers(tiny, tmp_path, fmt):
    from transformers import AutoModelForCausalLM

    model, calib = tiny
    out = tmp_path / fmt
    assert (
        _quantize(
            model,
            out,
            "--rtn",
            "--bits",
            "8",
            "--group-size",
            "channel",
            "--format",
            fmt,
            "--calib",
            str(calib),
            "--num-samples",
            "4",
            "--seq-len",
            "32",
        )
        == 0
    )
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    if fmt == "gptq":
        assert qcfg["group_size"] == -1
    else:
        assert qcfg["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    ours, _ = load_model(out, "float32", "cpu")
    dense, _ = load_model(model, "float32", "cpu")
    ids = torch.randint(0, 160, (1, 12), generator=torch.Generator().manual_seed(1))
    got, ref = ours.forward_dense(ids), dense.forward_dense(ids)
    assert (got - ref).norm() / ref.norm() < 0.05  # 8 bits per channel: close to the dense model
    if fmt == "compressed-tensors":
        hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(got, hf(ids).logits.float(), rtol=1e-3, atol=1e-3)


def test_ignore_pattern_that_matches_nothing_is_a_warning_naming_it(tiny, tmp_path):
    model, calib = tiny
    report = tmp_path / "r.json"
    assert (
        _quantize(
            model,
            tmp_path / "q",
            "--rtn",
            "--group-size",
            "32",
            "--calib",
            str(calib),
            "--num-samples",
            "4",
            "--seq-len",
            "32",
            "--ignore",
            "down_porj",
            "--ignore",
            "lm_head",
            "--ignore",
            "re:mlp\\.up_proj$",
            "--report-json",
            str(report),
        )
        == 0
    )
    warnings = [w for w in json.loads(report.read_text())["warnings"] if "--ignore" in w]
    assert warnings == ["--ignore 'down_porj' matches no linear layer of the model"]


def test_seq_len_above_the_context_is_capped_with_a_warning(tiny, tmp_path):
    model, calib = tiny
    rows = [{"prompt_token_ids": list(range(3, 160)) * 4} for _ in range(3)]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = tmp_path / "r.json"
    assert (
        _quantize(
            model,
            tmp_path / "q",
            "--rtn",
            "--group-size",
            "32",
            "--calib",
            str(tmp_path / "long.jsonl"),
            "--num-samples",
            "2",
            "--seq-len",
            "1000",
            "--report-json",
            str(report),
        )
        == 0
    )
    r = json.loads(report.read_text())
    assert r["calibration"]["seq_len"] == 256
    assert any("above the model's context" in w for w in r["warnings"])


@pytest.mark.parametrize(
    "content,needle",
    [
        (b"", "fewer than one sequence"),
        (b'{"prompt_token_ids": [1, 2\n', "c.jsonl:1: invalid JSON"),
        (b'{"prompt_token_ids": [' + b"9" * 5000 + b"]}\n", "c.jsonl:1: invalid JSON"),
        (b"[" * 100000 + b"]" * 100000 + b"\n", "c.jsonl:1: invalid JSON"),
        (
            b'{"prompt_token_ids": [5, 99999]}\n',
            "token id 99999 is outside the vocabulary (0 to 159)",
        ),
        (b'{"prompt_token_ids": [5, -1]}\n', "token id -1 is outside the vocabulary"),
        (b'{"prompt_token_ids": [true, 2]}\n', "prompt_token_ids must be a list of integers"),
        (b'{"text": "\xff\xfe"}\n', "not UTF-8"),
        (b'{"text": "no tokenizer here"}\n', "has no tokenizer"),
    ],
)
def test_bad_calibration_data_is_one_line(tiny, tmp_path, capsys, content, needle):
    model, _ = tiny
    (tmp_path / "c.jsonl").write_bytes(content)
    assert (
        _quantize(
            model,
            tmp_path / "q",
            "--gptq",
            "--group-size",
            "32",
            "--calib",
            str(tmp_path / "c.jsonl"),
            "--num-samples",
            "2",
            "--seq-len",
            "16",
        )
        == 2
    )
    _one_line_error(capsys, needle)
    assert not (tmp_path / "q").exists()  # nothing created for a run that could not start


def test_a_bom_and_a_corrupt_parquet(tiny, tmp_path, capsys):
    model, calib = tiny
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + calib.read_bytes())
    assert (
        _quantize(
            model,
            tmp_path / "q",
            "--rtn",
            "--group-size",
            "32",
            "--calib",
            str(bom),
            "--num-samples",
            "2",
            "--seq-len",
            "16",
        )
        == 0
    )
    (tmp_path / "c.parquet").write_bytes(b"PAR1 not really")
    assert (
        _quantize(
            model,
            tmp_path / "q2",
            "--rtn",
            "--group-size",
            "32",
            "--calib",
            str(tmp_path / "c.parquet"),
            "--seq-len",
            "16",
        )
        == 2
    )
    _one_line_error(capsys, "not a readable Parquet file")


def _examples(help_text: str) -> list[list[str]]:
    """The `llmctl ...` commands of a --help text's Examples block, continuation lines joined."""
    block = help_text.split("Examples", 1)[1].split("\n\n", 1)[0]
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.strip() for line in joined.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("llmctl ")]


@pytest.mark.parametrize(
    "help_text,count",
    [(quantize_cmd.HELP, 4), (sparsify_cmd.HELP, 3)],
    ids=["quantize", "sparsify"],
)
def test_every_help_example_runs_on_the_embedded_model(tmp_path, monkeypatch, help_text, count):
    monkeypatch.chdir(REPO)  # the examples name repository paths: llmctl/data/, examples/, recipes/
    examples = _examples(help_text)
    assert len(examples) == count  # quantize's fourth: --scheme w8a8 --smoothquant
    for argv in examples:
        i = argv.index("-o")
        out = tmp_path / argv[i + 1]
        argv[i + 1] = str(out)
        assert main([*argv, "--quiet"]) == 0, argv
        load_model(out, "float32", "cpu")  # and the output loads


def test_report_json_may_not_overwrite_an_input(tiny, tmp_path, capsys, no_loading):
    model, calib = tiny
    recipe = tmp_path / "r.yaml"
    recipe.write_text('sparsify: {method: wanda, pattern: "2:4"}\n')
    before = recipe.read_text()
    for flags, target in (
        (["--recipe", str(recipe)], recipe),
        ([], calib),
        ([], model / "config.json"),
    ):
        assert (
            main(
                [
                    "sparsify",
                    str(model),
                    "-o",
                    str(tmp_path / "o"),
                    "--calib",
                    str(calib),
                    *flags,
                    "--report-json",
                    str(target),
                    "--quiet",
                ]
            )
            == 2
        )
        _one_line_error(capsys, "would overwrite the input")
    assert recipe.read_text() == before
