"""2- and 3-bit weights: the dense 3-bit packing against AutoGPTQ's and compressed-tensors'
layouts, bit-exact round trips in compressed-tensors and GPTQ v1, what is refused, and
`llmctl quantize --bits 2|3` end to end (our loader's logits equal the dequantized reference, and
compressed-tensors' own decompress gives the same weights)."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl.cli import main
from llmctl.compress.quant.rtn import quantize_rtn
from llmctl.errors import ModelLoadError, UsageError
from llmctl.models.qlinear import QuantLinear, _int4_layout_ok
from llmctl.runtime.formats import read_quantized, write_quantized
from llmctl.runtime.formats.packing import UnpackedLinear, pack_rows, unpack_rows
from llmctl.runtime.formats.spec import QuantSpec
from llmctl.runtime.weights import load_model
from tests.test_quant_engine import write_tiny_dir

GEN = torch.Generator().manual_seed(0)


def _autogptq_pack3(values: torch.Tensor) -> list[list[int]]:
    """AutoGPTQ's 3-bit qweight packing, written the way its loop walks one run of 32 values
    (10 values, 1 straddling, 10, 1 straddling, 10) over rows of `values` [R, 32 * n]."""
    out = []
    for row in values.tolist():
        words = []
        for base in range(0, len(row), 32):
            v = row[base : base + 32]
            w0 = sum(v[j] << (3 * j) for j in range(10)) | ((v[10] << 30) & 0xFFFFFFFF)
            w1 = (v[10] >> 2) & 1
            w1 |= sum(v[11 + j] << (3 * j + 1) for j in range(10)) | ((v[21] << 31) & 0xFFFFFFFF)
            w2 = (v[21] >> 1) & 3
            w2 |= sum(v[22 + j] << (3 * j + 2) for j in range(10))
            words += [w0, w1, w2]
        out.append(words)
    return out


def test_three_bit_packing_is_autogptqs_and_compressed_tensors_layout():
    v = torch.randint(0, 8, (5, 96), generator=GEN, dtype=torch.int32)
    packed = pack_rows(v, 3)
    assert packed.shape == (5, 9)
    assert [[w & 0xFFFFFFFF for w in r] for r in packed.tolist()] == _autogptq_pack3(v)
    assert torch.equal(unpack_rows(packed, 3), v)
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    for bits in (2, 3):
        v = torch.randint(0, 2**bits, (4, 64), generator=GEN, dtype=torch.int32)
        signed = (v - (1 << (bits - 1))).to(torch.int8)  # what compressed-tensors packs
        assert torch.equal(pack_rows(v, bits), ct.pack_to_int32(signed, bits))
    with pytest.raises(UsageError, match="a multiple of 32"):
        pack_rows(torch.zeros(2, 48, dtype=torch.int32), 3)
    with pytest.raises(ModelLoadError, match="whole runs of 32"):
        unpack_rows(torch.zeros(2, 4, dtype=torch.int32), 3)


def _int4_kernel() -> bool:
    return _int4_layout_ok()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("out_f", [128, 48])  # int4 kernel (a multiple of 64) and nibbles
def test_quant_linear_holds_2_and_3_bit_codes_as_4_bit_ones(bits, out_f):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (out_f, 96), generator=g, dtype=torch.int32)
    scales = torch.rand(out_f, 3, generator=g) * 0.01 + 0.001
    zeros = torch.randint(0, 2**bits, (out_f, 3), generator=g, dtype=torch.int32)
    u = UnpackedLinear(codes, scales, zeros, torch.arange(96, dtype=torch.int32) // 32, bits, 32)
    q = QuantLinear.from_unpacked(u, torch.float32)
    assert q.use_int4_kernel is (out_f == 128 and _int4_kernel()) and q.storage_bits == 4
    assert torch.equal(q.codes().to(torch.int32), codes)
    assert q.qweight.numel() == out_f * 96 // 2  # two codes per byte, not one
    w = u.dequantize()
    torch.testing.assert_close(q.dequantize(), w, rtol=1e-6, atol=1e-7)
    for tokens in (1, 100):  # kernel (or dequantize) for small batches, dequantize above
        x = torch.randn(tokens, 96, generator=g)
        y, ref = q(x), x @ w.t()
        if q.use_int4_kernel and tokens <= q.SMALL_BATCH_TOKENS:  # float32 rows go in bf16
            assert 1e-5 < _rel(y, ref) < 1e-2
        else:
            torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def _write_read(tmp_path, fmt, spec, w):
    r = quantize_rtn(w, spec)
    qcfg = write_quantized(tmp_path, fmt, {}, {"layer.proj": r}, spec, [], torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qcfg}))
    return r, qcfg, read_quantized(tmp_path)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq"])
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("symmetric", [True, False])
def test_round_trip_is_bit_exact_at_2_and_3_bits(tmp_path, fmt, bits, symmetric):
    if fmt == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(bits))
    w[0, :16] = torch.rand(16) + 0.1  # all-positive group: asymmetric zero point 0 (v1 edge case)
    spec = QuantSpec(bits, 16, symmetric)
    r, qcfg, (_, linears, _) = _write_read(tmp_path, fmt, spec, w)
    assert int(r.codes.max()) == 2**bits - 1 and int(r.codes.min()) == 0  # every code used
    u = linears["layer.proj"]
    assert u.bits == bits
    assert torch.equal(u.codes, r.codes) and torch.equal(u.zeros, r.zeros)
    assert torch.equal(u.scales, r.scales) and torch.equal(u.dequantize(), r.weight)
    assert qcfg.get("bits", bits) == bits


def test_gptq_three_bits_refuses_widths_that_are_not_multiples_of_32(tmp_path):
    with pytest.raises(UsageError, match="48 output features are not a multiple of 32"):
        _write_read(tmp_path, "gptq", QuantSpec(3, 16), torch.randn(48, 64))
    with pytest.raises(UsageError, match="--bits must be 2, 3, 4 or 8, not 5"):
        QuantSpec(5)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--bits", "5"], "--bits must be 2, 3, 4 or 8, got 5"),
        (["--format", "awq", "--bits", "3"], "--format awq stores 4-bit weights only"),
    ],
)
def test_cli_refuses_unsupported_bits(tmp_path, capsys, extra, needle):
    out = tmp_path / "q"
    rc = main(["quantize", str(tmp_path), "-o", str(out), "--rtn", "--quiet", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


# ---- `llmctl quantize --bits 2|3` on a tiny random model, loaded back by our engine ----


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_dir(tmp_path_factory.mktemp("tiny-bits"), calib_rows=8)


def _quantize(tiny_dir, out, *extra) -> dict:
    report = out.parent / f"{out.name}.json"
    argv = ["quantize", str(tiny_dir), "-o", str(out), "--group-size", "32", "--quiet"]
    argv += ["--calib", str(tiny_dir / "calib.jsonl"), "--num-samples", "8", "--seq-len", "32"]
    assert main([*argv, "--report-json", str(report), *extra]) == 0
    return json.loads(report.read_text())


def _ct_decompressed(out) -> dict[str, torch.Tensor]:
    """Each linear's weight as compressed-tensors' own decompress reads our file."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(qcfg).config_groups["group_0"]
    tensors = load_file(str(out / "model.safetensors"))
    names = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_packed")}
    weights = {}
    for n in names:
        local = {k[len(n) + 1 :]: v for k, v in tensors.items() if k.startswith(n + ".")}
        weights[n] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    return weights


@pytest.mark.parametrize(
    "fmt,method,bits",
    [
        ("compressed-tensors", "--rtn", 2),
        ("compressed-tensors", "--gptq", 2),
        ("compressed-tensors", "--gptq", 3),
        ("compressed-tensors", "--awq", 3),
        ("compressed-tensors", "--awq", 2),
        ("gptq", "--gptq", 3),
        ("gptq", "--rtn", 2),
    ],
)
def test_quantize_at_2_and_3_bits_runs_in_our_engine(tiny_dir, tmp_path, fmt, method, bits):
    if fmt == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    out = tmp_path / "q"
    report = _quantize(tiny_dir, out, method, "--bits", str(bits), "--format", fmt)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    stored = qcfg["bits"] if fmt == "gptq" else qcfg["config_groups"]["group_0"]["weights"]
    assert (stored if fmt == "gptq" else stored["num_bits"]) == bits
    assert report["perplexity_after"] > 1 and len(report["layers"]) == 14
    model, _ = load_model(out, "float32", "cpu")
    q = model.model.layers[1].mlp.down_proj
    # 2/3-bit codes are held as 4-bit ones: the int4 kernel runs them (out 64 is its multiple)
    assert isinstance(q, QuantLinear) and q.bits == bits and q.use_int4_kernel is _int4_kernel()
    assert int(q.codes().max()) < 2**bits  # codes stay in range after the round trip
    _, linears, tensors = read_quantized(out)
    ref, _ = load_model(tiny_dir, "float32", "cpu")
    ref.load_state_dict({**tensors, **{f"{n}.weight": u.dequantize() for n, u in linears.items()}})
    orig, _ = load_model(tiny_dir, "float32", "cpu")
    for length in (8, 48):  # int4 kernel path (<= 32 tokens) and dequantize path
        ids = torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(length))
        a = model.forward_dense(ids)
        if length <= QuantLinear.SMALL_BATCH_TOKENS and _int4_kernel():  # rounds rows to bf16
            assert _rel(a, ref.forward_dense(ids)) < 1e-2
        else:
            torch.testing.assert_close(a, ref.forward_dense(ids), rtol=1e-4, atol=1e-4)
        assert 0 < float((a - orig.forward_dense(ids)).norm()) < float(a.norm())  # near, not equal
    if fmt == "compressed-tensors":
        for n, w in _ct_decompressed(out).items():
            torch.testing.assert_close(w, linears[n].dequantize(), rtol=0, atol=1e-6)


def test_transformers_loads_our_3_bit_compressed_tensors_output(tiny_dir, tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ct3"
    # symmetric: transformers refuses asymmetric pack-quantized files (see test_quant_engine.py)
    _quantize(tiny_dir, out, "--gptq", "--symmetric", "--bits", "3")
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours, _ = load_model(out, "float32", "cpu")
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    torch.testing.assert_close(ours.forward_dense(ids), ref, rtol=1e-3, atol=1e-3)
