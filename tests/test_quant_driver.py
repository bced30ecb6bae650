"""The layer-by-layer calibration driver and the quantization methods wired to it, on a tiny
random Llama built in the test."""

from __future__ import annotations

import pytest
import torch

from llmctl.compress.driver import calibrate_layers, make_ignore
from llmctl.compress.quant.layer_methods import AwqMethod, gptq_method, rtn_method
from llmctl.compress.records import LinearRecord
from llmctl.models.config import ModelConfig
from llmctl.models.layout import SUBLAYER_GROUPS
from llmctl.models.llama import LlamaForCausalLM
from llmctl.runtime.formats.spec import QuantSpec


def tiny_model(kv_heads=2, seed=0, hidden=64, ffn=96):
    cfg = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 97,
            "hidden_size": hidden,
            "intermediate_size": ffn,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5,
        }
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data = 1.0 + 0.2 * torch.rand_like(p)
        else:
            p.data = torch.randn_like(p) * 0.08
    return model.eval().requires_grad_(False)


def ids(n=6, s=24, seed=1):
    return torch.randint(0, 97, (n, s), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


class Zeroing:
    """A method that zeroes each group's weights and remembers what inputs it saw."""

    def __init__(self):
        self.seen = {}

    def observe(self, name, x):
        self.seen[name] = self.seen.get(name, 0.0) + float(x.abs().sum())

    def process_group(self, i, layer, group, names):
        for n in names:
            layer.get_submodule(n.split(".", 3)[3]).weight.zero_()
        return {n: "done" for n in names}

    def finish_layer(self, i, layer):
        return {}


def test_groups_are_calibrated_on_outputs_of_processed_groups():
    m = Zeroing()
    res = calibrate_layers(tiny_model(), ids(), m, ignore=make_ignore(["re:.*k_proj"]))
    assert len(res.records) == 2 * 6 and "model.layers.0.self_attn.k_proj" not in res.records
    assert m.seen["model.layers.0.self_attn.q_proj"] > 0
    assert (
        m.seen["model.layers.0.self_attn.o_proj"] == 0
    )  # v_proj was zeroed before o_proj was observed
    assert m.seen["model.layers.0.mlp.down_proj"] == 0  # gate/up zeroed before down_proj
    assert [g.name for g in SUBLAYER_GROUPS] == ["attn_in", "attn_out", "mlp_in", "mlp_out"]


class WholeLayerZeroing(Zeroing):
    whole_layer = True

    def __init__(self):
        super().__init__()
        self.forwards = 0


def test_whole_layer_method_observes_every_group_on_the_unprocessed_layer():
    model, m = tiny_model(), WholeLayerZeroing()

    def count(module, inputs):
        m.forwards += 1

    hooks = [layer.input_layernorm.register_forward_pre_hook(count) for layer in model.model.layers]
    res = calibrate_layers(model, ids(), m, batch_size=6)
    for h in hooks:
        h.remove()
    assert len(res.records) == 2 * 7
    # o_proj and down_proj saw the inputs of the layer before v_proj / gate / up were zeroed
    assert m.seen["model.layers.0.self_attn.o_proj"] > 0
    assert m.seen["model.layers.0.mlp.down_proj"] > 0
    # one observing pass and one output pass per layer (the grouped order takes five)
    assert m.forwards == 2 * 2


def test_whole_layer_gptq_records_every_linear_and_differs_from_grouped():
    spec = QuantSpec(4, 32, True, torch.float32)
    grouped, whole = tiny_model(), tiny_model()
    a = calibrate_layers(grouped, ids(), gptq_method(spec, whole_layer=False)).records
    b = calibrate_layers(whole, ids(), gptq_method(spec, whole_layer=True)).records
    assert a.keys() == b.keys() and len(b) == 2 * 7
    # q/k/v see the same inputs either way; o_proj's differ (v_proj quantized or not before it)
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert torch.equal(a[q].result.codes, b[q].result.codes)
    assert not torch.equal(a[o].result.codes, b[o].result.codes)


@pytest.mark.parametrize(
    "make", [lambda s: gptq_method(s), lambda s: rtn_method(s), lambda s: AwqMethod(s, n_grid=5)]
)
def test_methods_write_their_dequantized_weights_into_the_model(make):
    model, x = tiny_model(), ids()
    ref = model.forward_dense(x)
    res = calibrate_layers(model, x, make(QuantSpec(8, 32, scale_dtype=torch.float32)))
    assert len(res.records) == 14
    for name, rec in res.records.items():
        assert isinstance(rec, LinearRecord) and 0 <= rec.error < 1e-3
        assert torch.equal(model.get_submodule(name).weight, rec.result.weight)
    assert _rel(model.forward_dense(x), ref) < 0.02


def test_gptq_and_awq_beat_rtn_on_output_error_at_4_bits():
    errs = {}
    for label, make in (("rtn", rtn_method), ("gptq", gptq_method), ("awq", AwqMethod)):
        res = calibrate_layers(
            tiny_model(),
            ids(n=16),
            make(QuantSpec(4, 32, symmetric=False, scale_dtype=torch.float32)),
        )
        errs[label] = sum(r.error for r in res.records.values())
    assert errs["gptq"] < errs["rtn"] and errs["awq"] < errs["rtn"]


def test_awq_folds_v_into_o_without_gqa_and_keeps_the_function():
    model, x = tiny_model(kv_heads=4), ids()
    ref = model.forward_dense(x)
    v_before = model.model.layers[0].self_attn.v_proj.weight.clone()
    res = calibrate_layers(
        model, x, AwqMethod(QuantSpec(8, 32, scale_dtype=torch.float32), n_grid=4)
    )
    assert (
        res.records["model.layers.0.self_attn.o_proj"].alpha is not None
    )  # searched, since shapes allow
    assert not torch.allclose(model.model.layers[0].self_attn.v_proj.weight, v_before, atol=1e-3)
    assert _rel(model.forward_dense(x), ref) < 0.02
    gqa = calibrate_layers(tiny_model(kv_heads=2), x, AwqMethod(QuantSpec(8, 32), n_grid=2))
    assert gqa.records["model.layers.0.self_attn.o_proj"].alpha is None  # GQA: no v -> o folding


def test_interrupted_run_resumes_from_last_finished_layer(tmp_path):
    spec = QuantSpec(4, 32)
    full = tiny_model()
    calibrate_layers(full, ids(), gptq_method(spec))

    def stop_after_first(done, total):
        if done == 1:
            raise KeyboardInterrupt

    model = tiny_model()
    with pytest.raises(KeyboardInterrupt):
        calibrate_layers(
            model,
            ids(),
            gptq_method(spec),
            checkpoint_dir=tmp_path,
            fingerprint="a",
            progress=stop_after_first,
        )
    fresh = tiny_model()  # a new process: weights from the original checkpoint again
    seen = []
    res = calibrate_layers(
        fresh,
        ids(),
        gptq_method(spec),
        checkpoint_dir=tmp_path,
        fingerprint="a",
        progress=lambda d, t: seen.append(d),
    )
    assert res.resumed_layers == 1 and seen == [1, 2] and len(res.records) == 14
    for (n, a), b in zip(full.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    other = calibrate_layers(
        tiny_model(), ids(), gptq_method(spec), checkpoint_dir=tmp_path, fingerprint="b"
    )
    assert other.resumed_layers == 0
