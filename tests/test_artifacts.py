"""Checkpoints written through the ecosystem's own libraries: compressed-tensors' ModelCompressor
writes `quantization_config`, huggingface_hub's `save_torch_state_dict` writes the shards (quantize,
sparsify and distill), compressed-tensors' decompression reads back what our engine reads, and
what transformers does with our asymmetric output is recorded."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl.cli import main
from llmctl.errors import UsageError
from llmctl.runtime.formats import read_quantized
from llmctl.runtime.formats.ct import ASYMMETRIC_NOTE
from llmctl.runtime.shards import parse_shard_size
from llmctl.runtime.tensors import read_tensors
from llmctl.runtime.weights import load_model
from tests.test_quant_engine import write_tiny_dir

SMALL_SHARD = "20KB"  # the tiny model's ~100 KB of weights: several shards


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_dir(tmp_path_factory.mktemp("tiny-artifacts"), calib_rows=40)


def _quantize(tiny_dir, out, *extra):
    args = ["quantize", str(tiny_dir), "-o", str(out), "--group-size", "32"]
    args += ["--calib", str(tiny_dir / "calib.jsonl"), "--num-samples", "8", "--seq-len", "32"]
    return main([*args, *extra])


def _shards(folder):
    return sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))


def _logits(folder, ids):
    model, _ = load_model(folder, "float32", "cpu")
    with torch.no_grad():
        return model.forward_dense(ids)


def test_parse_shard_size():
    assert parse_shard_size("5GB") == 5 * 10**9
    assert parse_shard_size("500MB") == 500 * 10**6
    assert parse_shard_size("500mb") == 500 * 10**6
    assert parse_shard_size(4096) == 4096
    for bad in ("abc", "0", "-5MB", "5XB", "", True):
        with pytest.raises(UsageError, match="--max-shard-size"):
            parse_shard_size(bad)


def test_bad_max_shard_size_is_a_usage_error(tiny_dir, tmp_path, capsys):
    assert _quantize(tiny_dir, tmp_path / "q", "--rtn", "--max-shard-size", "lots") == 2
    assert "--max-shard-size takes" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_quantization_config_is_model_compressors(tiny_dir, tmp_path):
    import compressed_tensors
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "ct"
    assert _quantize(tiny_dir, out, "--rtn", "--quiet") == 0
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["version"] == compressed_tensors.__version__
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "pack-quantized"
    assert qcfg["sparsity_config"] == {}  # dense weights
    # what ModelCompressor writes for the parsed config is exactly what we wrote
    again = tmp_path / "again"
    again.mkdir()
    ModelCompressor(quantization_config=QuantizationConfig.model_validate(qcfg)).update_config(
        str(again)
    )
    assert json.loads((again / "config.json").read_text())["quantization_config"] == qcfg


@pytest.mark.parametrize("symmetric", ["--symmetric", "--asymmetric"])
def test_compressed_tensors_decompression_equals_our_engine(tiny_dir, tmp_path, symmetric):
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "ct"
    assert _quantize(tiny_dir, out, "--gptq", symmetric, "--quiet") == 0
    qcfg, linears, _ = read_quantized(out)
    scheme = next(iter(QuantizationConfig.model_validate(qcfg).config_groups.values()))
    tensors = read_tensors(out)
    assert len(linears) == 14  # 2 layers x 7 linears
    for name, u in linears.items():
        state = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(name + ".")}
        theirs = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        # our engine's dequantized weight, rounded to the checkpoint's scale dtype as theirs is
        ours = u.dequantize().to(theirs.dtype)
        torch.testing.assert_close(theirs, ours, rtol=0, atol=0)


def test_asymmetric_output_warns_and_transformers_refuses_it(tiny_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "awq"
    assert _quantize(tiny_dir, out, "--awq") == 0  # AWQ is asymmetric by default
    err = capsys.readouterr().err
    assert err.count(ASYMMETRIC_NOTE) == 1
    assert "vLLM and llmctl load it" in err
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(_logits(out, ids)).all()  # llmctl loads it
    # What transformers does today (this test fails when that changes, so the README can follow):
    # the packed weight_zero_point [out / 8, groups] meets its unpacked [out, groups] parameter.
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert _quantize(tiny_dir, tmp_path / "sym", "--awq", "--symmetric") == 0
    assert ASYMMETRIC_NOTE not in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["compressed-tensors", "awq", "gptq"])
def test_quantize_shards_above_max_shard_size(tiny_dir, tmp_path, fmt):
    one, many = tmp_path / "one", tmp_path / "many"
    flags = ("--rtn", "--format", fmt, "--quiet")
    assert _quantize(tiny_dir, one, *flags) == 0
    assert _quantize(tiny_dir, many, *flags, "--max-shard-size", SMALL_SHARD) == 0
    assert [p.name for p in one.glob("*.safetensors*")] == ["model.safetensors"]
    assert len(_shards(many)) >= 3
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == _shards(many)
    b = read_tensors(many)
    for shard in _shards(many):  # a tensor above the limit gets a shard of its own
        names = [k for k, f in index["weight_map"].items() if f == shard]
        size = sum(b[k].numel() * b[k].element_size() for k in names)
        assert size <= parse_shard_size(SMALL_SHARD) or len(names) == 1
    assert (many / _shards(many)[0]).stat().st_mode & 0o044  # not safetensors' 0600
    a = read_tensors(one)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(one, ids), _logits(many, ids))


def test_sparsify_shards_through_huggingface_hub(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sparse"
    args = ["sparsify", str(tiny_dir), "-o", str(out), "--method", "magnitude", "--no-eval"]
    assert main([*args, "--max-shard-size", SMALL_SHARD, "--quiet"]) == 0
    assert len(_shards(out)) >= 3 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] > 0
    assert sorted(set(index["weight_map"].values())) == _shards(out)
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(2))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(_logits(out, ids), ref, rtol=1e-4, atol=1e-4)


def test_sparse_then_quantized_recipe_shards_and_keeps_both_configs(tiny_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "sparsify:\n  method: magnitude\n  pattern: '2:4'\n"
        "quantize:\n  method: rtn\n  group_size: 32\n  symmetric: true\n"
    )
    out = tmp_path / "sq"
    args = ["sparsify", str(tiny_dir), "-o", str(out), "--recipe", str(recipe), "--no-eval"]
    args += ["--calib", str(tiny_dir / "calib.jsonl"), "--num-samples", "8", "--seq-len", "32"]
    assert main([*args, "--max-shard-size", SMALL_SHARD, "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["sparsity_config"]["pattern"] == "2:4"  # ours, beside compressed-tensors'
    # compressed-tensors 0.20 writes an empty sparsity_config (its sparsity support is removed,
    # and vLLM refuses a non-empty one), so the pattern stays in the top-level entry
    assert config["quantization_config"]["sparsity_config"] == {}
    assert len(_shards(out)) >= 3
    _, linears, _ = read_quantized(out)
    w = linears["model.layers.0.mlp.up_proj"].dequantize()
    assert float((w == 0).float().mean()) >= 0.5  # 2:4 survives quantization


def test_distill_output_shards(tmp_path):
    from tests.test_distill_cli import TINY, distill

    out = tmp_path / "student"
    assert distill(out, "--student-layers", "1", *TINY, "--max-shard-size", "1MB") == 0
    assert len(_shards(out)) >= 3 and not (out / "model.safetensors").exists()
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(3))
    assert torch.isfinite(_logits(out, ids)).all()


# The hand-written packer llmctl had before it used compressed-tensors' pack_to_int32 (kept here,
# verbatim in behaviour, as the reference the new files must match word for word).
def _legacy_pack_rows(values, bits, order=None):
    if 32 % bits:
        R, C = values.shape
        v = values.to(torch.int64).reshape(R, C // 32, 32) & ((1 << bits) - 1)
        words = torch.zeros(R, C // 32, bits + 1, dtype=torch.int64)
        for j in range(32):
            word, shift = divmod(j * bits, 32)
            words[:, :, word] |= (v[:, :, j] << shift) & 0xFFFFFFFF
            if shift + bits > 32:
                words[:, :, word + 1] |= v[:, :, j] >> (32 - shift)
        out = words[:, :, :bits].reshape(R, -1)
    else:
        per = 32 // bits
        R, C = values.shape
        order = order or list(range(per))
        v = values.to(torch.int64).reshape(R, C // per, per)[:, :, order] & ((1 << bits) - 1)
        out = (v << (torch.arange(per, dtype=torch.int64) * bits)).sum(dim=-1)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("fmt,bits", [("awq", 4), ("gptq", 4), ("gptq", 3), ("gptq", 8)])
def test_packing_on_compressed_tensors_is_word_for_word_the_old_one(tmp_path, fmt, bits):
    from llmctl.runtime.formats.awq import AWQ_ORDER
    from llmctl.runtime.resolve import DEMO_MODEL_DIR

    out = tmp_path / "q"
    args = ["quantize", str(DEMO_MODEL_DIR), "-o", str(out), "--rtn", "--format", fmt]
    assert main([*args, "--bits", str(bits), "--group-size", "32", "--quiet"]) == 0
    _, linears, _ = read_quantized(out)
    tensors = read_tensors(out)
    assert linears
    for name, u in linears.items():
        if fmt == "awq":
            words = _legacy_pack_rows(u.codes.t(), 4, AWQ_ORDER)
            zeros = _legacy_pack_rows(u.zeros.t(), 4, AWQ_ORDER)
        else:
            words = _legacy_pack_rows(u.codes, bits).t()
            zeros = _legacy_pack_rows((u.zeros.t() - 1) & ((1 << bits) - 1), bits)
        assert torch.equal(tensors[f"{name}.qweight"], words), name
        assert torch.equal(tensors[f"{name}.qzeros"], zeros), name
    # the old packer is one-to-one, so the codes (and dequantized weights) the new reader returns
    # are exactly the old reader's: the files and what they load to did not change


def test_a_full_disk_under_save_torch_state_dict_is_an_enospc_oserror(tmp_path, monkeypatch):
    import errno

    import huggingface_hub
    from safetensors import SafetensorError

    from llmctl.runtime.shards import save_sharded

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left (os error 28)")

    monkeypatch.setattr(huggingface_hub, "save_torch_state_dict", full)
    with pytest.raises(OSError) as caught:
        save_sharded({"w": torch.zeros(4)}, tmp_path / "out")
    assert caught.value.errno == errno.ENOSPC
