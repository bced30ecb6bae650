"""`llmctl recipe run` end to end on the embedded demo model: every recipe in recipes/ (with tiny
calibration, training and generation sizes so the suite stays fast), resume at the first
unfinished stage, and a changed recipe (refused, then rerun from the change with --overwrite)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from llmctl.cli import main
from llmctl.recipes import recipe_job, stages
from llmctl.runtime.resolve import DEMO_MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(DEMO_MODEL_DIR)
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
SMALL = {  # per stage: values that keep a run to seconds
    "eval": {"max_tokens": 64, "seq_len": 32},
    "distill": {"steps": 2, "batch_size": 2, "seq_len": 16, "warmup": 0},
    "run-batch": {"max_tokens": 2, "max_num_seqs": 2},
}


def stage_kinds(recipe: Path) -> list[str]:
    assert main(["recipe", "validate", str(recipe), "--model", DEMO, "-q"]) == 0
    plan = recipe_job.validate_recipe(recipe_job.RecipeRequest(recipe, model=DEMO))
    return [s.kind for s in plan.stages]


def small_flags(kinds: list[str], prompts: Path) -> list[str]:
    flags = ["--num-samples", "2", "--seq-len", "16", "--device", "cpu"]
    for kind in kinds:
        for key, value in SMALL.get(kind, {}).items():
            flags += ["--set", f"stages.{kind}.{key}={value}"]
    if "run-batch" in kinds:
        flags += ["--set", f"stages.run-batch.input={prompts}"]
    return flags


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "ROMEO:"}\n{"id": "b", "prompt": "JULIET:"}\n')
    return path


def check_stage(kind: str, folder: Path) -> None:
    """What each stage must leave in OUT/stages/KIND."""
    if kind in ("sparsify", "quantize", "distill"):
        config = json.loads((folder / "config.json").read_text())
        assert (folder / "model.safetensors").is_file()
        if kind == "quantize":
            assert config["quantization_config"]
        if kind == "sparsify":
            assert config["sparsity_config"]["pattern"] == "2:4"
        if kind == "distill":
            assert config["num_hidden_layers"] == 3  # half of the demo model's 6
    if kind == "eval":
        record = json.loads((folder / "report.json").read_text())
        assert math.isfinite(record["result"]["perplexity"])
        assert record["result"]["mean_kl"] >= 0  # against the source model
    if kind == "run-batch":
        rows = [json.loads(line) for line in (folder / "output.jsonl").read_text().splitlines()]
        assert [r["id"] for r in rows] == ["a", "b"]
        assert all(r["error"] is None and r["text"] is not None for r in rows)


@pytest.mark.parametrize("name", RECIPES)
def test_every_shipped_recipe_runs_on_the_demo_model(name, tmp_path, prompts, capsys):
    recipe = ROOT / "recipes" / name
    kinds = stage_kinds(recipe)
    out = tmp_path / "out"
    argv = ["recipe", "run", str(recipe), "--model", DEMO, "-o", str(out), "-q"]
    assert main(argv + small_flags(kinds, prompts)) == 0
    for kind in kinds:
        check_stage(kind, out / "stages" / kind)
    report = json.loads((out / "recipe_report.json").read_text())
    assert [(e["stage"], e["status"]) for e in report["stages"]] == [(k, "ran") for k in kinds]
    resolved = yaml.safe_load((out / "recipe.resolved.yaml").read_text())
    assert resolved["llmctl_recipe"] == 1 and list(resolved["stages"]) == kinds
    if "quantize" in kinds and "sparsify" in kinds:  # the pruned zeros survived quantization
        from llmctl.recipes.sparsify_run import zeros_not_kept
        from llmctl.runtime.tensors import read_tensors

        pruned = read_tensors(out / "stages" / "sparsify")
        masks = {n.removesuffix(".weight"): w == 0 for n, w in pruned.items() if "layers." in n}
        assert sum(int(m.sum()) for m in masks.values()) > 0
        assert zeros_not_kept(out / "stages" / "quantize", masks) == []
    capsys.readouterr()


def fast_recipe(tmp_path: Path) -> Path:
    text = tmp_path / "text.txt"
    text.write_text((ROOT / "llmctl/compress/data/calib_default.txt").read_text())
    doc = {
        "llmctl_recipe": 1,
        "model": DEMO,
        "calibration": {"calib": str(text), "num_samples": 2, "seq_len": 16},
        "stages": {
            "sparsify": {"method": "magnitude", "pattern": "2:4", "evaluate": False},
            "quantize": {"method": "rtn", "bits": 8, "group_size": "channel"},
            "eval": {"data": str(text), "seq_len": 32, "max_tokens": 64},
        },
    }
    path = tmp_path / "fast.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_a_rerun_resumes_at_the_first_unfinished_stage(tmp_path, monkeypatch, capsys):
    recipe, out = fast_recipe(tmp_path), tmp_path / "out"
    argv = ["recipe", "run", str(recipe), "-o", str(out), "-q"]
    real, ran = stages.run_stage, []

    def interrupted_at_quantize(stage, hooks):
        ran.append(stage.kind)
        if stage.kind == "quantize":
            raise KeyboardInterrupt
        return real(stage, hooks)

    monkeypatch.setattr(recipe_job, "run_stage", interrupted_at_quantize)
    assert main(argv) == 130
    assert ran == ["sparsify", "quantize"]
    pruned = out / "stages" / "sparsify" / "model.safetensors"
    stamp = pruned.stat().st_mtime_ns
    assert not (out / "stages" / "quantize" / "config.json").exists()

    ran.clear()
    monkeypatch.setattr(recipe_job, "run_stage", lambda s, h: ran.append(s.kind) or real(s, h))
    assert main(argv) == 0
    assert ran == ["quantize", "eval"]  # sparsify's own folder says it finished
    assert pruned.stat().st_mtime_ns == stamp
    report = json.loads((out / "recipe_report.json").read_text())
    assert [e["status"] for e in report["stages"]] == ["finished earlier", "ran", "ran"]
    assert report["stages"][0]["report"]["sparsify"]["method"] == "magnitude"

    ran.clear()
    assert main(argv) == 0  # everything finished: nothing runs
    assert ran == []
    capsys.readouterr()


def test_a_changed_recipe_needs_overwrite_and_reruns_from_the_change(tmp_path, capsys):
    recipe, out = fast_recipe(tmp_path), tmp_path / "out"
    argv = ["recipe", "run", str(recipe), "-o", str(out), "-q"]
    assert main(argv) == 0
    pruned = out / "stages" / "sparsify" / "model.safetensors"
    stamp = pruned.stat().st_mtime_ns
    capsys.readouterr()
    changed = argv + ["--set", "stages.quantize.bits=4", "--set", "stages.quantize.group_size=64"]
    assert main(changed) == 2
    err = capsys.readouterr().err
    assert "holds a run of another recipe (stages.quantize.bits: 8 -> 4)" in err
    assert "--overwrite to rerun from stage quantize" in err
    assert main(changed + ["--overwrite"]) == 0
    assert pruned.stat().st_mtime_ns == stamp  # before the change: kept
    config = json.loads((out / "stages" / "quantize" / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    resolved = yaml.safe_load((out / "recipe.resolved.yaml").read_text())
    assert resolved["stages"]["quantize"]["bits"] == 4
    # the calibration settings reach the first stage that reads them
    assert main(changed + ["--num-samples", "3"]) == 2
    assert "calibration.num_samples: 2 -> 3" in capsys.readouterr().err


def test_an_output_folder_of_something_else_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["recipe", "run", str(fast_recipe(tmp_path)), "-o", str(out), "-q"]) == 2
    assert "holds no earlier `llmctl recipe run`" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"
