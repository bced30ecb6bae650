"""The one-shot pipeline (llmctl.compress.oneshot): a step list on a tiny model, a recipe's two
steps in one job equal to sparsify then quantize as two commands, resume inside the second step,
the recipe schema's errors, the deprecated knob names, `--report-json -` and the options'
defaults (None in Typer, owned by the dataclasses)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from llmctl.cli import main
from llmctl.compress.args import QuantizeArgs, SparsifyArgs
from llmctl.errors import UsageError
from llmctl.runtime.semi_structured import satisfies_nm
from tests.conftest import REPO, make_random_model

CALIB = ["--num-samples", "8", "--seq-len", "32"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama (widths 64 and 96, no tokenizer) and a JSONL of token-id rows."""
    root = tmp_path_factory.mktemp("oneshot")
    model = make_random_model(root / "model", "llama", seed=5)
    g = torch.Generator().manual_seed(1)
    rows = [
        {"prompt_token_ids": torch.randint(3, 160, (40,), generator=g).tolist()} for _ in range(24)
    ]
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, calib


def _recipe(tmp_path, text: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def _quantized(folder):
    from llmctl.runtime.formats import read_quantized

    return read_quantized(folder)


def _same_quantized(a, b) -> None:
    _, lin_a, dense_a = _quantized(a)
    _, lin_b, dense_b = _quantized(b)
    assert sorted(lin_a) == sorted(lin_b) and sorted(dense_a) == sorted(dense_b)
    for name in lin_a:
        assert torch.equal(lin_a[name].dequantize(), lin_b[name].dequantize()), name
    for name in dense_a:
        assert torch.equal(dense_a[name], dense_b[name]), name


def test_a_step_list_runs_in_order_on_one_model(tiny, tmp_path):
    """run_oneshot with a prune step then a quantize step: each step's outcome, one output."""
    from llmctl.compress.oneshot import run_oneshot
    from llmctl.compress.quant.step import QuantizeStep
    from llmctl.compress.sparse.step import PruneStep

    model, calib = tiny
    shared = dict(model=str(model), output=str(tmp_path / "o"), calib=str(calib))
    sargs = SparsifyArgs(method="wanda", pattern="2:4", num_samples=6, seq_len=32, **shared)
    qargs = QuantizeArgs(method="rtn", group_size=32, num_samples=6, seq_len=32, **shared)
    steps = [PruneStep(sargs), QuantizeStep(qargs)]
    stages = []
    job = run_oneshot(sargs, steps, progress=lambda kind, d, t: stages.append((kind, d, t)))
    assert [o.step.kind for o in job.outcomes] == ["sparsify", "quantize"]
    assert stages[0] == ("sparsify", 1, 2) and stages[-1] == ("quantize", 2, 2)
    first, second = job.outcomes
    # the quantize step starts from the pruned model: its "before" is the prune step's "after"
    assert first.perplexity_after == pytest.approx(second.perplexity_before, rel=1e-6)
    assert first.perplexity_before != first.perplexity_after
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["sparsity_config"]["method"] == "wanda" and cfg["quantization_config"]
    _, linears, _ = _quantized(tmp_path / "o")
    assert len(linears) == 14
    for name, lin in linears.items():  # RTN maps a zero to its zero point: 2:4 survives
        assert satisfies_nm(lin.dequantize(), 2, 4), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_recipe_in_one_job_equals_sparsify_then_quantize(tiny, tmp_path, dtype):
    """Two steps in one job on the model in memory write exactly what two commands write through
    a saved sparse folder (weights rounded to the checkpoint's dtype in between)."""
    model, calib = tiny
    if dtype != "float32":  # the same weights, declared as a bfloat16 checkpoint
        import shutil

        shutil.copytree(model, tmp_path / "src")
        model = tmp_path / "src"
        cfg = json.loads((model / "config.json").read_text())
        cfg["torch_dtype"] = cfg["dtype"] = dtype
        (model / "config.json").write_text(json.dumps(cfg))
    data = ["--calib", str(calib), *CALIB, "--quiet"]
    sparse, two, one = tmp_path / "sparse", tmp_path / "two", tmp_path / "one"
    prune = ["--method", "sparsegpt", "--pattern", "2:4"]
    assert main(["sparsify", str(model), "-o", str(sparse), *prune, "--no-eval", *data]) == 0
    assert (
        main(["quantize", str(sparse), "-o", str(two), "--gptq", "--group-size", "32", *data]) == 0
    )
    recipe = _recipe(
        tmp_path,
        'sparsify: {method: sparsegpt, pattern: "2:4"}\nquantize: {method: gptq, group_size: 32}\n',
    )
    assert main(["sparsify", str(model), "-o", str(one), "--recipe", str(recipe), *data]) == 0
    _same_quantized(one, two)


def test_recipe_interrupted_in_its_quantize_step_resumes(tiny, tmp_path):
    model, calib = tiny
    recipe = _recipe(
        tmp_path,
        'sparsify: {method: sparsegpt, pattern: "2:4"}\nquantize: {method: gptq, group_size: 32}\n',
    )
    from llmctl.recipes.sparsify_recipe import load_recipe, merge_args
    from llmctl.recipes.sparsify_run import run_recipe

    def args(out):
        values = {"model": str(model), "output": str(out), "calib": str(calib), "seq_len": 32}
        return merge_args(load_recipe(recipe), {**values, "num_samples": 6, "evaluate": False})

    run_recipe(load_recipe(recipe), args(tmp_path / "whole").resolve())

    def stop(kind, done, total):
        if kind == "quantize" and done == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_recipe(load_recipe(recipe), args(tmp_path / "resumed").resolve(), progress=stop)
    resume = tmp_path / "resumed" / ".llmctl-work" / "resume"
    assert (resume / "progress.json").is_file() and (resume / "step-1" / "progress.json").is_file()
    report = run_recipe(load_recipe(recipe), args(tmp_path / "resumed").resolve())
    assert report.sparsify.resumed_layers == 2 and report.quantize.resumed_layers == 1
    assert any("step-1" in w for w in report.quantize.warnings)
    _same_quantized(tmp_path / "whole", tmp_path / "resumed")
    assert not (tmp_path / "resumed" / ".llmctl-work").exists()


@pytest.mark.parametrize(
    "text,needle",
    [
        ('sparsify: {pattern: "2:3"}', "recipe sparsify.pattern: --pattern 2:3 is not allowed"),
        ("sparsify: {sparsity: 2}", "recipe sparsify.sparsity: --sparsity must be between 0"),
        ("sparsify: {method: obs}", "recipe sparsify.method: unknown method 'obs'"),
        ("sparsify: {ignore: [1]}", "recipe sparsify.ignore: must be a list of strings"),
        ("sparsify: {column_block: 0}", "recipe sparsify.column_block: must be greater than"),
        ("sparsify: {dampening: 1.5}", "recipe sparsify.dampening: must be less than 1"),
        ("sparsify: {}\ncalibration: {seq_len: 1}", "recipe calibration.seq_len: must be greater"),
        ("sparsify: {}\nquantize: {format: gguf}", "recipe quantize.format: unknown format 'gguf'"),
        ("sparsify: {}\nquantize: {group_size: 48}", "recipe quantize.group_size: --group-size"),
        ("sparsify: {}\nquantize: {symmetric: 'no'}", "recipe quantize.symmetric: must be true"),
        ("sparsify: {}\nquantize: {bits: 4, group: 64}", "recipe quantize.group: unknown key"),
        ("sparsify: {}\nquantize: [gptq]", "recipe quantize: must be a mapping"),
    ],
)
def test_recipe_errors_name_the_field_path(tmp_path, text, needle):
    from llmctl.recipes.sparsify_recipe import load_recipe

    with pytest.raises(UsageError) as e:
        load_recipe(_recipe(tmp_path, text))
    message = str(e.value)
    assert needle in message and len(message.splitlines()) == 1, message
    assert message.startswith(str(tmp_path / "recipe.yaml"))


def test_old_block_size_names_warn_and_still_work(tiny, tmp_path, capsys):
    model, calib = tiny
    data = ["--calib", str(calib), *CALIB, "--no-eval", "--quiet"]
    flag = tmp_path / "flag"
    argv = ["sparsify", str(model), "-o", str(flag), "--block-size", "32", *data]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "--block-size is deprecated for sparsify; use --column-block" in err
    assert len([line for line in err.splitlines() if "deprecated" in line]) == 1
    assert "column_block: 32" in (flag / "recipe.yaml").read_text()
    key = tmp_path / "key"
    recipe = _recipe(tmp_path, 'sparsify: {pattern: "2:4", block_size: 32}\n')
    assert main(["sparsify", str(model), "-o", str(key), "--recipe", str(recipe), *data]) == 0
    err = capsys.readouterr().err
    assert "recipe sparsify.block_size is deprecated; use column_block" in err
    written = (key / "recipe.yaml").read_text()
    assert "column_block: 32" in written and "block_size" not in written
    # the same setting under either name gives the same model
    from safetensors.torch import load_file

    a, b = load_file(str(flag / "model.safetensors")), load_file(str(key / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_column_block_reaches_gptq_and_the_recipe(tiny, tmp_path, capsys):
    model, calib = tiny
    out = tmp_path / "q"
    argv = ["quantize", str(model), "-o", str(out), "--gptq", "--group-size", "32"]
    assert main([*argv, "--column-block", "32", "--calib", str(calib), *CALIB, "-q"]) == 0
    assert "column_block: 32" in (out / "recipe.yaml").read_text()
    bad = ["--column-block", "0", "--calib", str(calib), "-q"]
    assert main([*argv[:3], str(tmp_path / "bad"), *argv[4:], *bad]) == 2
    assert "--column-block must be a positive number" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["quantize", "sparsify"])
def test_report_json_dash_writes_json_to_stdout_and_no_table(tiny, tmp_path, capsys, command):
    model, calib = tiny
    method = ["--rtn", "--group-size", "32"] if command == "quantize" else ["--method", "magnitude"]
    argv = [command, str(model), "-o", str(tmp_path / "o"), *method, "--calib", str(calib), *CALIB]
    assert main([*argv, "--report-json", "-"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out)  # stdout is the JSON document and nothing else
    if command == "quantize":
        assert report["method"] == "rtn" and report["output"] == str(tmp_path / "o")
    else:
        assert report["sparsify"]["method"] == "magnitude" and report["quantize"] is None
    assert not (tmp_path / "-").exists()


def _options(command: str):
    import typer.main

    from llmctl.cli import app

    group = typer.main.get_command(app)
    return [p for p in group.commands[command].params if p.param_type_name == "option"]


@pytest.mark.parametrize("command", ["quantize", "sparsify"])
def test_typer_defaults_are_none_and_the_dataclasses_own_them(command):
    for param in _options(command):
        if param.name == "output":
            continue
        assert param.default in (None, False), (param.name, param.default)
    helps = {p.name: p.help for p in _options(command)}
    assert "(default: 128)" in helps["num_samples"] and "(default: 0.01)" in helps["dampening"]
    for args, name in ((QuantizeArgs, "quantize"), (SparsifyArgs, "sparsify")):
        assert f"{args.column_block} for {name}" in helps["column_block"]


def test_shared_knobs_have_one_default():
    from llmctl.commands._options import default_of

    # column_block is not shared: SparseGPT picks masks per block, GPTQ's result ignores it
    for name in ("num_samples", "seq_len", "dampening", "device", "ignore"):
        assert default_of(QuantizeArgs, name) == default_of(SparsifyArgs, name), name


def test_compress_imports_no_cli_and_recipe_has_no_circle():
    code = (
        "import sys, llmctl.recipes.sparsify_recipe as r, llmctl.recipes.sparsify_run;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'rich')"
        " or m.startswith('llmctl.commands')))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
    # reading a recipe needs no job: the run (sparsify_run) imports the jobs, not the reader
    code = (
        "import sys, llmctl.recipes.sparsify_recipe;"
        "print('llmctl.compress.sparse.job' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_recipe_sections_take_the_keys_a_run_writes():
    """compress.args lists the keys sparsify's recipe.yaml writes (compress may not import
    llmctl.recipes); they are exactly the keys the sections read back."""
    from llmctl.compress import args
    from llmctl.recipes.sections import (
        CalibrationSection,
        QuantizeSection,
        SparsifySection,
        keys,
    )

    assert keys(CalibrationSection) == args.CALIBRATION_KEYS
    assert keys(SparsifySection) == args.SPARSIFY_KEYS
    assert keys(QuantizeSection) == args.QUANTIZE_KEYS
