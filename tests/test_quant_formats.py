"""Quantized checkpoint formats: layouts checked word by word, and bit-exact round trips."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl.compress.quant.rtn import quantize_rtn
from llmctl.errors import UsageError
from llmctl.runtime.formats import read_quantized, write_quantized
from llmctl.runtime.formats.awq import AWQ_ORDER
from llmctl.runtime.formats.spec import QuantSpec


def _write_read(tmp_path, fmt, spec, w):
    r = quantize_rtn(w, spec)
    qcfg = write_quantized(
        tmp_path,
        fmt,
        {"model.norm.weight": torch.ones(4)},
        {"layer.proj": r},
        spec,
        [],
        torch.float32,
    )
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qcfg}))
    return r, qcfg, read_quantized(tmp_path)


@pytest.mark.parametrize(
    "fmt,bits,symmetric",
    [
        ("compressed-tensors", 4, True),
        ("compressed-tensors", 8, False),
        ("compressed-tensors", 4, False),
        ("awq", 4, False),
        ("awq", 4, True),
        ("gptq", 4, True),
        ("gptq", 8, False),
        ("gptq", 4, False),
    ],
)
def test_round_trip_is_bit_exact(tmp_path, fmt, bits, symmetric):
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(bits))
    w[0, :16] = (
        torch.rand(16) + 0.1
    )  # an all-positive group: asymmetric zero point 0, the v1 edge case
    spec = QuantSpec(bits, 16, symmetric, scale_dtype=torch.float16)
    r, qcfg, (qcfg2, linears, dense) = _write_read(tmp_path, fmt, spec, w)
    assert qcfg2["quant_method"] == fmt and list(dense) == ["model.norm.weight"]
    u = linears["layer.proj"]
    assert (
        torch.equal(u.codes, r.codes)
        and torch.equal(u.zeros, r.zeros)
        and torch.equal(u.scales, r.scales)
    )
    assert torch.equal(u.dequantize(), r.weight)


def test_awq_layout_word_by_word(tmp_path):
    from safetensors.torch import load_file

    w = torch.randn(8, 16)
    r, _, _ = _write_read(tmp_path, "awq", QuantSpec(4, 16, False), w)
    t = load_file(str(tmp_path / "model.safetensors"))
    assert t["layer.proj.qweight"].shape == (16, 1) and t["layer.proj.scales"].shape == (1, 8)
    assert t["layer.proj.scales"].dtype == torch.float16
    for col in (
        0,
        5,
    ):  # input column: one word holding the 8 output rows in AWQ's interleaved order
        expected = sum(int(r.codes[AWQ_ORDER[i], col]) << (4 * i) for i in range(8))
        assert int(t["layer.proj.qweight"][col, 0]) & 0xFFFFFFFF == expected


def test_gptq_layout_word_by_word(tmp_path):
    from safetensors.torch import load_file

    w = torch.randn(8, 16)
    r, qcfg, _ = _write_read(tmp_path, "gptq", QuantSpec(4, 16, True), w)
    t = load_file(str(tmp_path / "model.safetensors"))
    assert t["layer.proj.qweight"].shape == (2, 8) and t["layer.proj.qzeros"].shape == (1, 1)
    assert t["layer.proj.g_idx"].tolist() == [0] * 16 and qcfg["sym"] is True
    expected = sum(
        int(r.codes[3, 8 + i]) << (4 * i) for i in range(8)
    )  # row 1 = input columns 8..15
    assert int(t["layer.proj.qweight"][1, 3]) & 0xFFFFFFFF == expected
    assert int(t["layer.proj.qzeros"][0, 0]) & 0xFFFFFFFF == 0x77777777  # v1: zero 8 stored as 7


def test_compressed_tensors_config_and_awq_refuses_8_bits(tmp_path):
    _, qcfg, _ = _write_read(
        tmp_path, "compressed-tensors", QuantSpec(4, 16, True), torch.randn(8, 16)
    )
    assert qcfg["format"] == "pack-quantized" and "lm_head" in qcfg["ignore"]
    assert qcfg["config_groups"]["group_0"]["weights"]["group_size"] == 16
    with pytest.raises(UsageError, match="4-bit"):
        _write_read(tmp_path, "awq", QuantSpec(8, 16, True), torch.randn(8, 16))
