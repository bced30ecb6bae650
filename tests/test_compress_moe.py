"""MoE experts quantized and pruned one by one (issue 36): transformers 5's fused experts unfused
into per-expert linears (models/unfused_experts.py) with the fused forward, each expert calibrated
on its routed tokens (a starved one as without data), written under the per-expert checkpoint
names, and loaded back natively and on the transformers path."""

from __future__ import annotations

import json

import pytest
import torch
from archs import PROMPTS, build, greedy, one_thread, save_word_tokenizer, write_words  # noqa: F401

from llmctl import LLM, SamplingParams
from llmctl.cli import main
from llmctl.compress import driver
from llmctl.models.qlinear import QuantLinear
from llmctl.models.unfused_experts import UnfusedExperts, unfuse_experts
from llmctl.runtime.semi_structured import satisfies_nm

FUSED = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
EXPERT = {"mixtral": "model.layers.{}.block_sparse_moe.experts.{}.{}"}
PROJ = {"mixtral": ("w1", "w3", "w2")}


def _expert_names(arch: str, layers: int = 2, experts: int = 4) -> list[str]:
    form = EXPERT.get(arch, "model.layers.{}.mlp.experts.{}.{}")
    projections = PROJ.get(arch, ("gate_proj", "up_proj", "down_proj"))
    return [
        form.format(i, e, p) for i in range(layers) for e in range(experts) for p in projections
    ]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """Words w0..w149 (one token each with the tokenizer of `_save`)."""
    return write_words(tmp_path_factory.mktemp("text") / "text.txt")


def _save(folder, arch: str, seed: int = 0):
    """The tiny model of `arch` (routing that rounding does not flip) with a word tokenizer."""
    build(arch, seed, initializer_range=0.1).save_pretrained(folder)
    save_word_tokenizer(folder)


def _cli(*args) -> None:
    assert main([*map(str, args), "--quiet"]) == 0


def _calib(text):  # 128 calibration tokens: every expert of the tiny models gets some
    return ("--calib", text, "--num-samples", "4", "--seq-len", "32")


@pytest.mark.parametrize("arch", FUSED)
def test_unfused_experts_compute_the_fused_forward(arch):
    """The whole model's logits are bit-equal with the experts unfused (against transformers'
    eager experts loop; its default grouped_mm kernel sums in another order, within 1e-5), the
    weights split as the checkpoint splits them, and other layouts are left fused."""
    model = build(arch, initializer_range=0.1)
    ids = torch.randint(3, 160, (3, 20), generator=torch.Generator().manual_seed(0))
    fused = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()  # [E, 2I, H]
    with torch.no_grad():
        grouped = model(ids).logits  # transformers' default kernel
        model.config._experts_implementation = "eager"
        before = model(ids).logits
    assert unfuse_experts(model) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, UnfusedExperts) and len(experts) == 4
    gate, up, _ = experts[2].projections()
    assert torch.equal(torch.cat([gate.weight, up.weight]), fused[2])
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(after, before)
    torch.testing.assert_close(after, grouped, rtol=0, atol=1e-5)
    for other in ("gpt_oss", "deepseek_v3"):
        assert unfuse_experts(build(other)) == []


def _dequantized(out, src, folder):
    """The quantized output `out` as a dense float32 folder: its packed linears dequantized (by
    llmctl's native loader), its other tensors as written; transformers loads and fuses it."""
    from safetensors.torch import load_file, save_file

    llm = LLM(str(out), dtype="float32", device="cpu")
    state = load_file(str(out / "model.safetensors"))
    state = {k: v for k, v in state.items() if not k.endswith(("_packed", "_scale", "_shape"))}
    packed = [(n, m) for n, m in llm.runtime.model.named_modules() if isinstance(m, QuantLinear)]
    state |= {f"{n}.weight": m.dequantize(torch.float32).contiguous() for n, m in packed}
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    return llm, {n for n, _ in packed}


def _llm_greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outs]


# seeds whose greedy top-1 margins on PROMPTS are wide (above 0.04) before quantizing
@pytest.mark.parametrize(
    ("arch", "method", "bits", "seed"), [("qwen2_moe", "rtn", 8, 7), ("mixtral", "gptq", 4, 3)]
)
def test_quantized_experts_load_and_match_transformers(tmp_path, text, arch, method, bits, seed):
    """Every expert is written packed under its checkpoint name (the shared expert too), the
    ignore list names routers and gates only, and the output loads natively with each expert a
    QuantLinear; its greedy tokens in float32 equal transformers' generate on the dequantized
    weights (which transformers fuses again at load), at a clear top-1 margin."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src, out = tmp_path / "src", tmp_path / "out"
    _save(src, arch, seed)
    settings = ("--bits", bits, "--group-size", 16)
    _cli("quantize", src, "-o", out, f"--{method}", *settings, *_calib(text))
    written = load_file(str(out / "model.safetensors"))
    experts = _expert_names(arch)
    shared = ["model.layers.0.mlp.shared_expert.up_proj"] if arch == "qwen2_moe" else []
    for name in experts + shared:
        assert f"{name}.weight_packed" in written and f"{name}.weight" not in written, name
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert not [n for n in ignore if "experts" in n]
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    assert f"model.layers.1.{block}.gate" in ignore
    if arch == "qwen2_moe":
        assert "model.layers.1.mlp.shared_expert_gate" in ignore
    llm, packed = _dequantized(out, src, tmp_path / "dequantized")
    assert set(experts + shared) <= packed
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized").eval()
    tokens, gap = greedy(reference, PROMPTS, 8)
    assert gap > 1e-3  # no near-tie a last-bit difference could flip
    assert _llm_greedy(llm) == tokens
    # transformers loads the output itself (compressed-tensors decompresses the per-expert
    # tensors into its fused experts), with the same tokens
    direct = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert greedy(direct, PROMPTS, 8)[0] == tokens


def test_quantized_experts_load_on_the_transformers_path(tmp_path, text):
    """mixtral with --model-impl transformers: the experts are unfused at load, each quantized
    projection swapped in by name (block_sparse_moe in the checkpoint is transformers' mlp), and
    the greedy tokens equal the native path's."""
    src, out = tmp_path / "src", tmp_path / "out"
    _save(src, "mixtral")
    _cli("quantize", src, "-o", out, "--rtn", "--bits", 8, "--group-size", 16, *_calib(text))
    native = LLM(str(out), dtype="float32", device="cpu")
    hf = LLM(str(out), dtype="float32", device="cpu", model_impl="transformers")
    modules = dict(hf.runtime.model.hf.named_modules())
    assert isinstance(modules["model.layers.1.mlp.experts"], UnfusedExperts)
    assert isinstance(modules["model.layers.1.mlp.experts.3.w2"], QuantLinear)
    assert _llm_greedy(hf) == _llm_greedy(native)


class _Spy(driver.HessianMethod):
    """GPTQ's driver plumbing with a recording per-linear function: the tokens each linear's
    hook saw and whether its Hessian was the identity."""

    def __init__(self):
        super().__init__(self.record)
        self.tokens: dict[str, int] = {}
        self.identity: dict[str, bool] = {}

    def observe(self, name, x):
        self.tokens[name] = self.tokens.get(name, 0) + x.numel() // x.shape[-1]
        super().observe(name, x)

    def record(self, name, linear, H):
        self.identity[name] = torch.equal(H, torch.eye(linear.in_features))


def test_each_expert_calibrates_on_its_routed_tokens_and_a_starved_one_without_data(tmp_path):
    """qwen3_moe on 4 x 32 tokens (top-2 of 4 experts: 64 per expert on average): each expert's
    hooks see only the tokens routed to it (together twice the layer's tokens), an expert with
    fewer than MIN_ROUTED_TOKENS gets H = I (the starved rule: round-to-nearest for GPTQ), the
    others a Hessian of their own."""
    from llmctl.models.linears import prepare_for_compression
    from llmctl.runtime.weights import load_model

    src = tmp_path / "src"
    build("qwen3_moe", initializer_range=0.1).save_pretrained(src)
    model, _ = load_model(src, "float32", "cpu", "transformers")
    prepare_for_compression(model, lambda msg: None)
    ids = torch.randint(3, 160, (4, 32), generator=torch.Generator().manual_seed(0))
    spy = _Spy()
    driver.calibrate_layers(model, ids, spy, batch_size=2)
    for layer in range(2):
        downs = [f"model.layers.{layer}.mlp.experts.{e}.down_proj" for e in range(4)]
        assert sum(spy.tokens.get(n, 0) for n in downs) == 2 * ids.numel()
        starved = [n for n in downs if spy.tokens.get(n, 0) < driver.MIN_ROUTED_TOKENS]
        assert starved and len(starved) < 4, spy.tokens  # both kinds, in this deterministic run
        for n in downs:
            assert spy.identity[n] == (n in starved), n
            gate = n.replace("down_proj", "gate_proj")
            assert spy.identity[gate] == (n in starved) and spy.tokens.get(gate, 0) == (
                spy.tokens.get(n, 0)
            )
        assert not spy.identity[f"model.layers.{layer}.self_attn.q_proj"]


@pytest.mark.parametrize("method", ["wanda", "sparsegpt", "magnitude"])
def test_sparsify_prunes_each_expert(tmp_path, text, method):
    """qwen2_moe 2:4: every expert (and the shared expert) holds the pattern in the written
    checkpoint and is listed in sparsity_config's layers, the routers and the shared expert's
    gate are untouched and ignored, and the output loads natively and generates."""
    from safetensors.torch import load_file

    src, out = tmp_path / "src", tmp_path / "out"
    _save(src, "qwen2_moe")
    calib = _calib(text) if method != "magnitude" else ()
    _cli("sparsify", src, "-o", out, "--method", method, "--pattern", "2:4", *calib)
    written = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())["sparsity_config"]
    for name in _expert_names("qwen2_moe") + ["model.layers.1.mlp.shared_expert.down_proj"]:
        assert name in config["layers"] and satisfies_nm(written[f"{name}.weight"], 2, 4), name
    assert not [n for n in config["ignore"] if "experts" in n]
    assert "model.layers.0.mlp.shared_expert_gate" in config["ignore"]
    gate = written["model.layers.0.mlp.shared_expert_gate.weight"]
    assert bool((gate != 0).all())
    llm = LLM(str(out), dtype="float32", device="cpu")
    assert all(len(t) == 8 for t in _llm_greedy(llm))


def test_experts_are_observed_together_by_role(tmp_path):
    """The traced groups of a qwen2_moe layer: q/k/v, o, the shared expert's gate/up and down,
    then every expert's gate/up in one group and every expert's down in one (two forward passes
    for all experts instead of two each); routers and the shared expert's gate in none."""
    from llmctl.compress.layer_runners import TransformersRunner
    from llmctl.models.linears import prepare_for_compression
    from llmctl.runtime.weights import load_model

    build("qwen2_moe", initializer_range=0.1).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, "float32", "cpu", "transformers")
    prepare_for_compression(model, lambda msg: None)
    runner = TransformersRunner(model)
    ids = torch.randint(3, 160, (2, 32), generator=torch.Generator().manual_seed(0))
    hidden = runner.start(ids, 2)
    groups = [g.linears for g in runner.groups(0, runner.layers[0], hidden, "cpu")]
    every = [n for g in groups for n in g]
    assert not [n for n in every if n.endswith(("gate", "shared_expert_gate"))]
    ups = [g for g in groups if "mlp.experts.0.up_proj" in g][0]
    downs = [g for g in groups if "mlp.experts.0.down_proj" in g][0]
    assert {f"mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj")} == set(ups)
    assert {f"mlp.experts.{e}.down_proj" for e in range(4)} == set(downs)
    assert groups.index(ups) + 1 == groups.index(downs) and len(groups) == 6


def test_w8a8_quantizes_the_experts_and_loads(tmp_path, text):
    """--scheme w8a8 on an MoE model (calibrated on transformers' model, where the linears' names
    are under the root module): every expert is written int8 with its per-channel scale and
    loads natively as an Int8Linear."""
    from safetensors.torch import load_file

    from llmctl.models.qlinear_int8 import Int8Linear

    src, out = tmp_path / "src", tmp_path / "out"
    _save(src, "qwen3_moe")
    _cli("quantize", src, "-o", out, "--rtn", "--scheme", "w8a8", *_calib(text))
    written = load_file(str(out / "model.safetensors"))
    for name in _expert_names("qwen3_moe"):
        assert written[f"{name}.weight"].dtype == torch.int8 and f"{name}.weight_scale" in written
    llm = LLM(str(out), dtype="float32", device="cpu")
    modules = dict(llm.runtime.model.named_modules())
    experts = [n for n, m in modules.items() if ".experts." in n and isinstance(m, Int8Linear)]
    assert len(experts) == len(_expert_names("qwen3_moe"))
    assert all(len(t) == 8 for t in _llm_greedy(llm))
