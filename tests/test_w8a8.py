"""W8A8 int8 (issue 38): the int8 kernels against exact PyTorch references, Int8Linear,
SmoothQuant's migration, `quantize --scheme w8a8` end to end (compressed-tensors int-quantized,
checked with compressed_tensors' own classes), an llm-compressor-style checkpoint built by hand,
and the one-line errors for combinations the scheme refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from llmctl.cli import main
from llmctl.compress.quant import smoothquant as sq
from llmctl.kernels.cpu.linear import int8 as k8
from llmctl.models.qlinear_int8 import Int8Linear
from llmctl.runtime.formats.packing import UnpackedLinear
from llmctl.runtime.weights import load_model
from tests.test_quant_engine import TINY, write_tiny_dir

pytest.importorskip("compressed_tensors")
DEMO = Path(__file__).resolve().parents[1] / "llmctl" / "data" / "demo-model"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _int8(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_dir(tmp_path_factory.mktemp("tiny-w8a8"), calib_rows=40)


# --- kernels -------------------------------------------------------------------------------------


def test_quantize_rows_is_symmetric_per_token_and_handles_zero_rows():
    x = torch.randn(5, 40) * torch.tensor([1.0, 10.0, 0.1, 3.0, 0.0])[:, None]
    codes, scale = k8.quantize_rows(x)
    assert codes.dtype == torch.int8 and scale.shape == (5, 1)
    assert codes.abs().amax(dim=1)[:4].eq(127).all()  # each row's largest value maps to 127
    assert codes[4].eq(0).all() and scale[4].item() == 1.0  # all-zero row: no division by 0
    torch.testing.assert_close(codes.float() * scale, x, atol=float(scale.max()) / 2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_quantize_rows_gives_the_reference_codes_and_scales(dtype):
    if not k8.native_applies(torch.zeros(1, 1)):
        pytest.skip("no C compiler: the native kernels are not built")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 1536, generator=g) * torch.rand(300, 1, generator=g) * 10).to(dtype)
    x[0] = 0
    x = torch.cat([x, x], dim=1)[:, ::2]  # a strided view: the kernel reads rows by stride
    codes, scale = k8.quantize_rows(x)
    ncodes, nscale = k8.quantize_rows_native(x)
    assert torch.equal(ncodes, codes) and torch.equal(nscale, scale)
    acc = torch.randint(-(2**20), 2**20, (300, 96), dtype=torch.int32, generator=g)
    ws = torch.rand(96, generator=g)
    ref = k8._rescale(acc, scale, ws, torch.float32)
    got = k8.rescale_native(acc, scale, ws, dtype)
    assert got.dtype == dtype
    assert _rel(got, ref) < (1e-6 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("rows,k,n", [(1, 64, 48), (5, 96, 64), (17, 576, 192), (64, 256, 704)])
def test_int_mm_is_exact_against_the_int64_reference(rows, k, n):
    if not k8.int_mm_exact():
        pytest.skip("torch._int_mm saturates on this CPU (no VNNI): the int8 kernels are not used")
    xq, wq = _int8((rows, k), rows), _int8((n, k), n)
    ref = k8.int_mm_reference(xq, wq)
    assert ref.dtype == torch.int32
    assert torch.equal(k8.int_mm(xq, wq), ref)


def _saturating_int_mm(xq: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """oneDNN's u8 x s8 GEMM on x86 without VNNI: x + 128 as u8 times w, neighbouring products
    added into int16 with saturation (vpmaddubsw), the 128 * sum(w) compensation taken after."""
    u, w = xq.to(torch.int64) + 128, wt.t().to(torch.int64)  # [M, K], [N, K]
    pairs = (u[:, None, 0::2] * w[None, :, 0::2] + u[:, None, 1::2] * w[None, :, 1::2]).clamp(
        -(2**15), 2**15 - 1
    )  # [M, N, K / 2]
    return (pairs.sum(-1) - 128 * w.sum(-1)[None, :]).to(torch.int32)


def test_a_saturating_int8_gemm_is_detected_and_served_by_dequant(monkeypatch):
    """Where torch._int_mm saturates (an x86 CPU without VNNI; measured with PyTorch capped at
    AVX2, BENCHMARKS W8A-e), the probe finds it, neither torch._int_mm kernel is chosen (only the
    exact C GEMM or dequant), and an explicit one falls back to dequant: W8A8 outputs stay
    right."""
    xq, wq = _int8((4, 64), 1), _int8((8, 64), 2)
    xq[0], wq[0] = 127, 127
    assert not torch.equal(_saturating_int_mm(xq, wq.t()), k8.int_mm_reference(xq, wq))
    monkeypatch.setattr(torch, "_int_mm", _saturating_int_mm)
    with pytest.warns(RuntimeWarning, match="saturates"):
        assert not k8.int_mm_exact.__wrapped__("cpu")
    monkeypatch.setattr(k8, "int_mm_exact", lambda device="cpu": False)
    k8.choose_kernel.cache_clear()
    try:
        exact = "int8_c" if k8.c_gemm_applies(torch.zeros(1, 1)) else "dequant"
        assert k8.choose_kernel(64, 96, 16, torch.float32) in (exact, "dequant")
        x, ws = torch.randn(9, 96), torch.rand(64) * 1e-2 + 1e-3
        wq = _int8((64, 96), 3)
        want = k8.w8a8_linear(x, wq, ws, "dequant")
        for kernel in ("int_mm", "int_mm_native"):
            assert torch.equal(k8.w8a8_linear(x, wq, ws, kernel), want)
    finally:
        k8.choose_kernel.cache_clear()


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (3, 33, 7), (17, 576, 193), (130, 1536, 64)])
def test_the_c_int8_gemm_is_exact(m, k, n):
    """The C GEMM (for CPUs whose torch._int_mm saturates): exact int32 sums, with rows of x not
    a multiple of its 4-row tile, an odd number of weight rows and K not a multiple of 16, and
    codes of +-127 (where the saturating GEMM fails)."""
    if not k8.c_gemm_applies(torch.zeros(1, 1)):
        pytest.skip("the C int8 GEMM needs AVX2 and a C compiler")
    xq, wq = _int8((m, k), m), _int8((n, k), n)
    xq[0], wq[0], wq[-1] = 127, 127, -127
    assert torch.equal(k8.int_mm_c(xq, wq), k8.int_mm_reference(xq, wq))


@pytest.mark.parametrize("kernel", ["int_mm", "int_mm_native", "dequant", "int8_c"])
def test_w8a8_linear_kernels_match_the_reference(kernel):
    x = torch.randn(9, 96)
    wq, ws = _int8((64, 96), 1), torch.rand(64) * 1e-2 + 1e-3
    xq, xs = k8.quantize_rows(x)
    ref = k8.int_mm_reference(xq, wq).double() * xs.double() * ws.double()
    y = k8.w8a8_linear(x, wq, ws, kernel)
    assert y.dtype == x.dtype and y.shape == (9, 64)
    tol = 1e-6 if kernel != "dequant" else 1e-5  # exact int32 sums vs float32 accumulation
    assert _rel(y, ref) < tol
    yb = k8.w8a8_linear(x.bfloat16(), wq, ws, kernel)
    assert yb.dtype == torch.bfloat16 and _rel(yb, ref) < 2e-2


def test_choose_kernel_picks_a_candidate_and_buckets_rows():
    assert k8.choose_kernel(64, 96, 16, torch.float32) in k8.INT8_KERNELS
    assert [k8.bucket(r) for r in (1, 15, 16, 200, 4096)] == [1, 1, 16, 128, 512]


def _unpacked_int8(out_f, in_f, seed=0):
    q = _int8((out_f, in_f), seed).to(torch.int32).clamp(-127, 127)
    scales = torch.rand(out_f, 1, generator=torch.Generator().manual_seed(seed)) * 1e-2 + 1e-3
    zeros = torch.full((out_f, 1), 128, dtype=torch.int32)
    g_idx = torch.zeros(in_f, dtype=torch.int32)
    return UnpackedLinear(q + 128, scales, zeros, g_idx, 8, in_f, int8_activations=True)


@pytest.mark.parametrize("kernel", [None, "int_mm", "int_mm_native", "dequant"])
def test_int8_linear_matches_quantized_activations_times_dequantized_weight(kernel):
    u = _unpacked_int8(48, 64)
    layer = Int8Linear.from_unpacked(u, torch.float32)
    layer.kernel = kernel
    assert torch.equal(layer.codes(), u.codes)
    x = torch.randn(2, 7, 64)
    xq, xs = k8.quantize_rows(x.reshape(-1, 64))
    ref = (xq.float() * xs) @ u.dequantize().t()
    y = layer(x)
    assert y.shape == (2, 7, 48)
    torch.testing.assert_close(y.reshape(-1, 48), ref, rtol=1e-5, atol=1e-5)
    if kernel is None:
        assert list(layer.plan) == [1] and layer.plan[1] in k8.INT8_KERNELS  # 14 rows: bucket 1


# --- SmoothQuant -------------------------------------------------------------------------------


def test_smoothing_scales_follow_the_formula():
    act = torch.tensor([4.0, 1.0, 0.25])
    w1 = torch.tensor([[1.0, -2.0, 0.5], [0.5, 1.0, -1.0]])
    w2 = torch.tensor([[2.0, 0.5, 0.25]])
    s = sq.smoothing_scales(act, [w1, w2], 0.5)
    wmax = torch.tensor([2.0, 2.0, 1.0])
    torch.testing.assert_close(s, act.sqrt() / wmax.sqrt())
    assert torch.equal(sq.smoothing_scales(act, [w1], 1.0), act)  # strength 1: all on weights


def test_apply_smoothing_keeps_the_function_and_flattens_the_activations():
    torch.manual_seed(0)
    from llmctl.models.layers import RMSNorm

    norm = RMSNorm(8, 1e-5)
    norm.weight.data = torch.rand(8) + 0.5
    lins = [nn.Linear(8, 6, bias=False), nn.Linear(8, 4, bias=False)]
    x = torch.randn(32, 8) * torch.tensor([1, 1, 30, 1, 1, 1, 0.1, 1.0])  # an outlier channel
    before = [lin(norm(x)) for lin in lins]
    spread = norm(x).abs().amax(0)
    s = sq.smoothing_scales(spread, [lin.weight for lin in lins], 0.8)
    sq.apply_smoothing(norm, lins, s)
    for lin, b in zip(lins, before):
        torch.testing.assert_close(lin(norm(x)), b, rtol=1e-4, atol=1e-5)
    after = norm(x).abs().amax(0)
    assert after.max() / after.min() < spread.max() / spread.min()  # outliers moved to W

    prev = nn.Linear(8, 8)  # v_proj -> o_proj: rows and bias of prev divided
    o = nn.Linear(8, 5, bias=False)
    ref = o(prev(x))
    sq.apply_smoothing(prev, [o], torch.rand(8) + 0.5)
    torch.testing.assert_close(o(prev(x)), ref, rtol=1e-4, atol=1e-5)


def test_down_proj_is_smoothed_through_up_proj():
    """mlp_out, beyond llm-compressor's default mappings: down_proj's input act(gate) * up is
    smoothed by dividing up_proj's rows (legal: one to one); the MLP is unchanged and its
    outliers flatter (on SmolLM2 this took W8A8 from +3.2% to +1.75% perplexity)."""
    import torch.nn.functional as F

    from llmctl.models.layout import SUBLAYER_GROUPS

    group = next(g for g in SUBLAYER_GROUPS if g.name == "mlp_out")
    torch.manual_seed(0)
    gate, up = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)
    down = nn.Linear(16, 8, bias=False)
    up.weight.data[3] *= 40  # an outlier channel of down's input

    def mlp(x):
        return down(F.silu(gate(x)) * up(x))

    x = torch.randn(64, 8)
    ref, spread = mlp(x), (F.silu(gate(x)) * up(x)).abs().amax(0)
    assert sq.can_smooth(group, up, [down])
    sq.apply_smoothing(up, [down], sq.smoothing_scales(spread, [down.weight], 0.8))
    torch.testing.assert_close(mlp(x), ref, rtol=1e-4, atol=1e-5)
    after = (F.silu(gate(x)) * up(x)).abs().amax(0)
    assert after.max() / after.min() < spread.max() / spread.min()


# --- quantize --scheme w8a8 end to end ---------------------------------------------------------


def _quantize(model_dir, out, *extra, calib=True):
    report = out.parent / f"{out.name}.json"
    args = ["quantize", str(model_dir), "-o", str(out), "--report-json", str(report), "--quiet"]
    if calib:
        args += ["--calib", str(model_dir / "calib.jsonl")]
    rc = main([*args, "--num-samples", "8", "--seq-len", "32", *extra])
    return rc, (json.loads(report.read_text()) if report.exists() else None)


def _check_ct_layout(out: Path) -> dict:
    """The folder holds what compressed-tensors expects of W8A8, read with its own classes."""
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    cfg = QuantizationConfig.model_validate(qcfg)
    assert cfg.format == "int-quantized" and cfg.quant_method == "compressed-tensors"
    (scheme,) = cfg.config_groups.values()
    w, a = scheme.weights, scheme.input_activations
    assert (w.num_bits, w.type, w.strategy, w.symmetric, w.dynamic) == (
        8,
        "int",
        "channel",
        True,
        False,
    )
    assert (a.num_bits, a.type, a.strategy, a.symmetric, a.dynamic) == (
        8,
        "int",
        "token",
        True,
        True,
    )
    assert "lm_head" in cfg.ignore
    t = load_file(out / "model.safetensors")
    q = t["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert t["model.layers.0.self_attn.q_proj.weight_scale"].shape == (q.shape[0], 1)
    assert t["model.embed_tokens.weight"].is_floating_point()  # embeddings, norms, head: dense
    assert t["model.norm.weight"].is_floating_point()
    assert "lm_head.weight_scale" not in t
    return t


@pytest.mark.parametrize("method", ["--rtn", "--gptq"])
def test_quantize_w8a8_writes_int_quantized_that_loads_as_int8_linears(tiny_dir, tmp_path, method):
    out = tmp_path / "w8a8"
    rc, report = _quantize(tiny_dir, out, method, "--scheme", "w8a8")
    assert rc == 0
    assert report["scheme"] == "w8a8" and report["bits"] == 8 and report["group_size"] == "channel"
    assert report["smoothquant_strength"] is None and report["perplexity_rtn_probe"] is None
    assert report["perplexity_after"] == pytest.approx(report["perplexity_before"], rel=0.05)
    _check_ct_layout(out)
    assert "scheme: w8a8" in (out / "recipe.yaml").read_text()
    model, _ = load_model(out, "float32", "cpu")
    assert isinstance(model.model.layers[1].mlp.down_proj, Int8Linear)
    orig, _ = load_model(tiny_dir, "float32", "cpu")
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    assert _rel(model.forward_dense(ids), orig.forward_dense(ids)) < 0.03


def test_transformers_loads_our_w8a8_output(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "w8a8-hf"
    assert _quantize(tiny_dir, out, "--rtn", "--scheme", "w8a8")[0] == 0
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours, _ = load_model(out, "float32", "cpu")
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    assert _rel(ours.forward_dense(ids), ref) < 0.03


def test_quantize_w8a8_smoothquant_runs_and_stays_close(tiny_dir, tmp_path):
    out = tmp_path / "sq"
    rc, report = _quantize(
        tiny_dir, out, "--rtn", "--scheme", "w8a8", "--smoothquant-strength", "0.5"
    )
    assert rc == 0 and report["smoothquant_strength"] == 0.5
    t = _check_ct_layout(out)
    raw = load_model(tiny_dir, "float32", "cpu")[0].state_dict()
    # the norms carry 1/s now
    assert not torch.equal(
        t["model.layers.0.input_layernorm.weight"], raw["model.layers.0.input_layernorm.weight"]
    )
    model, _ = load_model(out, "float32", "cpu")
    orig, _ = load_model(tiny_dir, "float32", "cpu")
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    assert _rel(model.forward_dense(ids), orig.forward_dense(ids)) < 0.03


def test_demo_model_w8a8_generates_in_llm_and_run_batch(tmp_path):
    from llmctl import LLM, SamplingParams

    out = tmp_path / "demo-w8a8"
    rc, _ = _quantize(DEMO, out, "--gptq", "--scheme", "w8a8", "--smoothquant", calib=False)
    assert rc == 0
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = ["First Citizen:", "ROMEO: What light"]
    got = LLM(str(out)).generate(prompts, params, use_tqdm=False)
    ref = LLM(str(DEMO)).generate(prompts, params, use_tqdm=False)
    assert all(len(r.outputs[0].token_ids) == 8 for r in got)
    # int8 of a well-trained model: the greedy continuations start the same
    assert [r.outputs[0].token_ids[:2] for r in got] == [r.outputs[0].token_ids[:2] for r in ref]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p, "max_tokens": 4}) + "\n" for p in prompts))
    res = tmp_path / "o.jsonl"
    assert main(["run-batch", str(inp), "-o", str(res), "-m", str(out), "-q"]) == 0
    rows = [json.loads(line) for line in res.read_text().splitlines()]
    assert len(rows) == 2 and all(r.get("text") for r in rows)


def test_llm_compressor_style_w8a8_checkpoint_loads(tiny_dir, tmp_path):
    """A W8A8 folder as llm-compressor writes it: int8 weight, bf16 weight_scale [out, 1], its
    preset scheme serialized by compressed-tensors, built here without our writer."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from safetensors.torch import load_file, save_file

    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    cfg = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="int-quantized",
        quantization_status="compressed",
        ignore=["lm_head"],
    )
    dense = load_file(tiny_dir / "model.safetensors")
    tensors, ref_weights = {}, {}
    for name, w in dense.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            scale = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.bfloat16)
            q = torch.round(w / scale.float()).clamp(-127, 127).to(torch.int8)
            tensors[name], tensors[name[:-6] + "weight_scale"] = q, scale
            ref_weights[name] = q.float() * scale.float()
        else:
            tensors[name] = w
    out = tmp_path / "llmc"
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    qcfg = json.loads(cfg.model_dump_json())
    qcfg["quant_method"] = "compressed-tensors"
    (out / "config.json").write_text(json.dumps({**TINY, "quantization_config": qcfg}))
    model, _ = load_model(out, "float32", "cpu")
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, Int8Linear)
    torch.testing.assert_close(
        layer.dequantize(torch.float32), ref_weights["model.layers.0.self_attn.q_proj.weight"]
    )
    orig, _ = load_model(tiny_dir, "float32", "cpu")
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    assert _rel(model.forward_dense(ids), orig.forward_dense(ids)) < 0.03


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--rtn", "--scheme", "w8a8", "--bits", "4"], "stores 8-bit weights, not --bits 4"),
        (["--awq", "--scheme", "w8a8"], "takes --rtn or --gptq, not --awq"),
        (["--rtn", "--scheme", "w8a8", "--format", "gptq"], "compressed-tensors int-quantized"),
        (["--rtn", "--scheme", "w8a8", "--group-size", "32"], "not --group-size 32"),
        (["--rtn", "--scheme", "w8a8", "--asymmetric"], "symmetric"),
        (["--rtn", "--smoothquant"], "--smoothquant needs --scheme w8a8"),
        (["--rtn", "--scheme", "w8a8", "--smoothquant-strength", "1.5"], "in [0, 1]"),
        (["--rtn", "--scheme", "w4a16"], "unknown --scheme 'w4a16'"),
    ],
)
def test_bad_w8a8_combinations_are_one_line_errors(tiny_dir, tmp_path, capsys, extra, message):
    out = tmp_path / "bad"
    assert main(["quantize", str(tiny_dir), "-o", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()
