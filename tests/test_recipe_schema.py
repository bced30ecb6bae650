"""`llmctl recipe validate` and the recipe loader: schema errors name the key, llm-compressor's
syntax maps onto our stages (other modifiers refused by name), paths and command-line values.
Nothing here runs a stage (tests/test_recipe_run.py does)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from llmctl.cli import main
from llmctl.errors import UsageError
from llmctl.recipes.llmcompressor import translate
from llmctl.recipes.recipe_job import RecipeRequest, load_plan
from llmctl.runtime.resolve import DEMO_MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent
DEMO = str(DEMO_MODEL_DIR)


def write(tmp_path: Path, doc, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    return path


def ours(**stages) -> dict:
    return {"llmctl_recipe": 1, "model": DEMO, "stages": stages}


def plan(path: Path, **kw):
    return load_plan(RecipeRequest(path, **kw))


def error(path: Path, **kw) -> str:
    with pytest.raises(UsageError) as e:
        plan(path, **kw)
    return str(e.value)


@pytest.mark.parametrize(
    ("doc", "want"),
    [
        (ours(quantize={"bits": 5}), "recipe stages.quantize.bits: must be 2, 3, 4 or 8, got 5"),
        (ours(quantize={"bitz": 4}), "recipe stages.quantize.bitz: unknown key; allowed: method"),
        (ours(quantize={"bits": "4"}), "recipe stages.quantize.bits: must be an integer, got '4'"),
        (ours(prune={}), "recipe stages.prune: unknown key; allowed: sparsify, quantize, distill"),
        (ours(eval={"seq_len": 8}), "recipe stages.eval.data: required key missing"),
        (ours(distill={"data": "x.txt", "steps": "ten"}), "stages.distill.steps: must be an"),
        (ours(**{"run-batch": {"input": "x", "temperature": True}}), "run-batch.temperature"),
        (ours(sparsify={"pattern": 124}), 'quote the pattern, for example pattern: "2:4"'),
        (ours(quantize=[1]), "recipe stages.quantize: must be a mapping of keys to values"),
        ({"llmctl_recipe": 2, "stages": {"eval": {}}}, "recipe llmctl_recipe: must be 1"),
        ({**ours(eval={"data": "x"}), "extra": 1}, "recipe extra: unknown key; allowed: llmctl"),
        (ours(quantize={}, sparsify={}), "quantize, sparsify are out of order"),
        (ours(), "recipe stages: empty"),
    ],
)
def test_schema_errors_name_the_key(tmp_path, doc, want):
    assert want in error(write(tmp_path, doc))


def test_job_rules_are_checked_before_any_stage_and_name_the_stage(tmp_path):
    data = write(tmp_path, "some text", "t.txt")
    doc = ours(quantize={"bits": 4}, distill={"data": str(data), "student_layers": 1, "steps": 0})
    assert error(write(tmp_path, doc)) == "recipe stages.distill: steps must be at least 1, got 0"
    doc = ours(eval={"data": "missing.txt"})
    assert "recipe stages.eval: data " in error(write(tmp_path, doc))
    # the model's shapes: 128 does not divide the demo model's 704-wide MLP input
    doc = ours(quantize={"group_size": 128})
    assert error(write(tmp_path, doc)).startswith("recipe stages.quantize: ")


def test_a_file_that_is_no_recipe_is_refused(tmp_path):
    assert "not valid YAML" in error(write(tmp_path, "a: [1"))
    assert "not a recipe llmctl reads" in error(write(tmp_path, {"quantise": {}}))
    assert "expected a mapping" in error(write(tmp_path, "- 1\n"))
    doc = {"llmctl_recipe": 1, "stages": {"eval": {"data": "x"}}}
    assert "no model: give --model" in error(write(tmp_path, doc))
    missing = str(tmp_path / "no-such-model")
    assert error(write(tmp_path, doc), model=missing).startswith("recipe model: model folder")


def test_relative_paths_are_read_beside_the_recipe_and_flags_from_here(tmp_path, monkeypatch):
    sub = tmp_path / "recipes"
    sub.mkdir()
    (tmp_path / "text.txt").write_text("hello world " * 50)
    doc = {**ours(quantize={"method": "rtn"}, eval={"data": "../text.txt"}), "model": None}
    doc["calibration"] = {"calib": "../text.txt", "num_samples": 64}
    path = write(sub, doc)
    here = tmp_path / "elsewhere"
    here.mkdir()
    (here / "mine.txt").write_text("mine")
    monkeypatch.chdir(here)
    p = plan(path, model=DEMO, calibration={"eval_data": "mine.txt", "num_samples": 2})
    assert p.doc["stages"]["eval"]["data"] == str(tmp_path / "text.txt")
    assert p.doc["calibration"]["calib"] == str(tmp_path / "text.txt")
    assert p.doc["calibration"]["eval_data"] == str(here / "mine.txt")
    assert p.doc["calibration"]["num_samples"] == 2  # the flag wins over the recipe's 64
    assert p.doc["model"] == DEMO


def test_set_overrides_any_value_and_is_validated_like_the_file(tmp_path):
    path = write(tmp_path, ours(sparsify={"pattern": "2:4"}, quantize={"bits": 4}))
    p = plan(path, sets=["stages.quantize.bits=8", "stages.sparsify.pattern=4:8"])
    assert p.doc["stages"]["quantize"]["bits"] == 8
    assert p.doc["stages"]["sparsify"]["pattern"] == "4:8"
    assert "stages.quantize.bits: must be 2, 3, 4 or 8, got 7" in error(
        path, sets=["stages.quantize.bits=7"]
    )
    assert "expected KEY.PATH=VALUE" in error(path, sets=["stages.quantize.bits"])


def test_resolved_recipe_fills_in_the_defaults_and_validates_again(tmp_path):
    path = write(tmp_path, ours(sparsify={}, quantize={}))
    first = plan(path)
    assert first.doc["stages"]["sparsify"]["method"] == "sparsegpt"
    assert first.doc["stages"]["quantize"] == {
        **first.doc["stages"]["quantize"],
        "method": "gptq",
        "bits": 4,
        "symmetric": True,
    }
    assert first.doc["calibration"]["num_samples"] == 128
    again = plan(write(tmp_path, first.doc, "resolved.yaml"))
    assert again.doc == first.doc
    # quantize reads what sparsify wrote
    assert [s.model for s in first.stages] == [DEMO, str(first.out / "stages" / "sparsify")]


GPTQ_W4A16 = {
    "quant_stage": {
        "quant_modifiers": {
            "GPTQModifier": {
                "targets": "Linear",
                "scheme": "W4A16",
                "ignore": ["lm_head", "re:.*mlp.down_proj"],
                "dampening_frac": 0.05,
                "actorder": "static",
            }
        }
    }
}


def test_llmcompressor_gptq_scheme():
    doc, origins = translate(GPTQ_W4A16)
    q = doc["stages"]["quantize"]
    assert q == {
        "method": "gptq",
        "bits": 4,
        "symmetric": True,
        "group_size": 128,
        "ignore": ["re:.*mlp.down_proj"],
        "dampening": 0.05,
        "act_order": True,
    }
    assert origins["stages.quantize.bits"] == "quant_stage.quant_modifiers.GPTQModifier.scheme"


@pytest.mark.parametrize(
    ("mods", "want"),
    [
        ({"QuantizationModifier": {"scheme": "W8A16"}}, {"method": "rtn", "bits": 8}),
        ({"AWQModifier": {"scheme": "W4A16_ASYM"}}, {"method": "awq", "symmetric": False}),
        (
            {"AWQModifier": {}, "QuantizationModifier": {"scheme": "W4A16_ASYM"}},
            {"method": "awq", "bits": 4, "group_size": 128},
        ),
        (
            {
                "GPTQModifier": {
                    "config_groups": {
                        "g": {
                            "targets": ["Linear"],
                            "weights": {"num_bits": 8, "strategy": "channel", "symmetric": False},
                        }
                    }
                }
            },
            {"bits": 8, "group_size": "channel", "symmetric": False},
        ),
    ],
)
def test_llmcompressor_quantization_modifiers(mods, want):
    q = translate({"stage_0_stage": {"run_type": "oneshot", "q_modifiers": mods}})[0]
    assert want.items() <= q["stages"]["quantize"].items()


def test_llmcompressor_w8a8_with_smoothquant():
    mods = {
        "SmoothQuantModifier": {"smoothing_strength": 0.8},
        "GPTQModifier": {"targets": "Linear", "scheme": "W8A8", "ignore": ["lm_head"]},
    }
    doc, origins = translate({"quant_stage": {"quant_modifiers": mods}})
    assert doc["stages"]["quantize"] == {
        "method": "gptq",
        "scheme": "w8a8",
        "bits": 8,
        "symmetric": True,
        "group_size": "channel",
        "ignore": [],
        "smoothquant": True,
        "smoothquant_strength": 0.8,
    }
    assert origins["stages.quantize.smoothquant_strength"].endswith("smoothing_strength")
    # SmoothQuant in a stage of its own before the quantization, with llm-compressor's default
    doc, _ = translate(
        {
            "smooth_stage": {"m_modifiers": {"SmoothQuantModifier": {}}},
            "quant_stage": {"m_modifiers": {"QuantizationModifier": {"scheme": "W8A8"}}},
        }
    )
    q = doc["stages"]["quantize"]
    assert q["method"] == "rtn" and q["smoothquant_strength"] == 0.5


def test_our_recipe_takes_scheme_w8a8_and_refuses_other_bits(tmp_path):
    from llmctl.recipes.sections import QuantizeSection

    s = QuantizeSection.model_validate({"scheme": "W8A8", "smoothquant_strength": 0.6})
    assert (s.scheme, s.smoothquant, s.smoothquant_strength) == ("w8a8", True, 0.6)
    with pytest.raises(ValueError, match="stores 8-bit weights, not bits 4"):
        QuantizeSection.model_validate({"scheme": "w8a8", "bits": 4})
    with pytest.raises(ValueError, match="unknown scheme 'w4a4'"):
        QuantizeSection.model_validate({"scheme": "w4a4"})


def test_llmcompressor_pruning_then_quantization(tmp_path):
    doc = {
        "sparsity_stage": {
            "sparsity_modifiers": {
                "SparseGPTModifier": {
                    "sparsity": 0.5,
                    "mask_structure": "2:4",
                    "targets": ["Linear"],
                    "ignore": ["re:.*lm_head"],
                }
            }
        },
        "quant_stage": {
            "quant_modifiers": {"QuantizationModifier": {"scheme": "W8A16", "ignore": ["lm_head"]}}
        },
    }
    stages = translate(doc)[0]["stages"]
    assert list(stages) == ["sparsify", "quantize"]
    assert stages["sparsify"] == {"method": "sparsegpt", "ignore": [], "pattern": "2:4"}
    wanda = {"s_stage": {"m_modifiers": {"WandaPruningModifier": {"sparsity": 0.3}}}}
    assert translate(wanda)[0]["stages"]["sparsify"]["sparsity"] == 0.3
    # W8A16's groups of 128 columns do not divide the demo model's 704: refused before any stage,
    # naming the modifier of their file
    message = error(write(tmp_path, doc, "lc.yaml"), model=DEMO)
    assert message.startswith("recipe quant_stage.quant_modifiers.QuantizationModifier: ")
    assert "group sizes that work for every layer: 16, 32, 64" in message


@pytest.mark.parametrize(
    ("doc", "want"),
    [
        (
            {"s_stage": {"m_modifiers": {"SmoothQuantModifier": {}}}},
            "SmoothQuantModifier: SmoothQuant prepares int8 activations",
        ),
        (
            {"s_stage": {"m_modifiers": {"GPTQModifier": {"scheme": "FP8"}}}},
            "s_stage.m_modifiers.GPTQModifier.scheme: FP8 is not an integer scheme",
        ),
        (
            {
                "s_stage": {
                    "m_modifiers": {"GPTQModifier": {"scheme": "W4A16"}, "SmoothQuantModifier": {}}
                }
            },
            "SmoothQuant prepares int8 activations",
        ),
        ({"s_stage": {"m_modifiers": {"FooModifier": {}}}}, "does not implement FooModifier"),
        (
            {"s_stage": {"m_modifiers": {"GPTQModifier": {"scheme": "W4A16", "foo": 1}}}},
            "s_stage.m_modifiers.GPTQModifier.foo: unknown key",
        ),
        (
            {"s_stage": {"m_modifiers": {"GPTQModifier": {"scheme": "W4A16", "targets": "Emb"}}}},
            "GPTQModifier.targets: 'Emb'",
        ),
        (
            {"s_stage": {"run_type": "train", "m_modifiers": {}}},
            "s_stage.run_type: 'train'; llmctl runs oneshot stages only",
        ),
        (
            {"s_stage": {"m_modifiers": {"SparseGPTModifier": {"sparsity": "half"}}}},
            "SparseGPTModifier.sparsity: must be a number, got 'half'",
        ),
        (
            {"s_stage": {"m_modifiers": {"GPTQModifier": {}, "AWQModifier": {}}}},
            "GPTQModifier and AWQModifier in one run",
        ),
    ],
)
def test_llmcompressor_refusals_name_their_key(doc, want):
    with pytest.raises(UsageError) as e:
        translate(doc)
    assert want in str(e.value)


def test_llmcompressor_value_errors_name_their_key(tmp_path):
    doc = {"q_stage": {"q_modifiers": {"GPTQModifier": {"scheme": "W4A16", "dampening_frac": 2}}}}
    assert "recipe q_stage.q_modifiers.GPTQModifier.dampening_frac:" in error(
        write(tmp_path, doc), model=DEMO
    )


def test_validate_command_prints_the_resolved_recipe_and_exits_2_on_errors(tmp_path, capsys):
    recipe = ROOT / "recipes" / "sparse24-sparsegpt-then-gptq.yaml"
    assert main(["recipe", "validate", str(recipe), "--model", DEMO, "--num-samples", "3"]) == 0
    out = capsys.readouterr().out
    assert "valid (llmctl syntax); stages: sparsify, quantize, eval, run-batch" in out
    resolved = yaml.safe_load(out)
    assert resolved["calibration"]["num_samples"] == 3
    assert resolved["stages"]["sparsify"]["pattern"] == "2:4"
    bad = write(tmp_path, ours(quantize={"bits": 5}))
    assert main(["recipe", "validate", str(bad)]) == 2
    assert "stages.quantize.bits" in capsys.readouterr().err


def test_sparsify_recipe_points_a_multi_stage_recipe_to_recipe_run(tmp_path, capsys):
    recipe = ROOT / "recipes" / "w4a16-gptq.yaml"
    assert main(["sparsify", DEMO, "-o", str(tmp_path / "o"), "--recipe", str(recipe)]) == 2
    assert "llmctl recipe run" in capsys.readouterr().err


def test_recipes_sit_between_the_commands_and_the_four_peers():
    """Only commands/ imports llmctl.recipes, which imports neither typer nor rich."""
    import ast

    def imports(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    package = ROOT / "llmctl"
    for path in (package / "recipes").glob("*.py"):
        assert not {n.split(".")[0] for n in imports(path)} & {"typer", "rich"}, path
    for peer in ("batch", "compress", "profiling", "train", "runtime", "engine", "models"):
        for path in (package / peer).rglob("*.py"):
            assert not any(n.startswith("llmctl.recipes") for n in imports(path)), path
