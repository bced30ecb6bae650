"""Quantized checkpoints in the engine: packed QuantLinear, `llmctl quantize` end to end on a tiny
random model (all three formats), loading them back through the runtime loader, transformers
interop for compressed-tensors, and calibration data reading."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl.cli import main
from llmctl.compress.calib_data import cut_sequences, load_calibration, read_token_stream
from llmctl.errors import UsageError
from llmctl.models.qlinear import QuantLinear
from llmctl.runtime.formats import read_quantized
from llmctl.runtime.formats.packing import UnpackedLinear
from llmctl.runtime.weights import load_model


def _unpacked(out_f, in_f, bits=4, gs=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=g, dtype=torch.int32)
    scales = torch.rand(out_f, in_f // gs, generator=g) * 0.01 + 0.001
    zeros = torch.randint(0, 2**bits, (out_f, in_f // gs), generator=g, dtype=torch.int32)
    return UnpackedLinear(
        codes, scales, zeros, torch.arange(in_f, dtype=torch.int32) // gs, bits, gs
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("out_f,bits,kernel", [(128, 4, True), (48, 4, False), (64, 8, False)])
def test_quant_linear_matches_dequantized_matmul(out_f, bits, kernel):
    u = _unpacked(out_f, 96, bits)
    q = QuantLinear.from_unpacked(u, torch.float32)
    assert q.use_int4_kernel is kernel
    assert torch.equal(q.codes().to(torch.int32), u.codes)  # kept packed, nothing lost
    w = u.dequantize()
    for tokens in (
        1,
        5,
        100,
    ):  # kernel for small batches, dequantize + matmul above SMALL_BATCH_TOKENS
        x = torch.randn(tokens, 96)
        y, ref = q(x), x @ w.t()
        if kernel and tokens <= q.SMALL_BATCH_TOKENS:  # float32 rows go through the kernel in bf16
            assert y.dtype == torch.float32 and 1e-5 < _rel(y, ref) < 1e-2
        else:
            torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)
    assert q(x).shape == (2, 3, out_f) and q(x).dtype == torch.bfloat16


def test_quant_linear_regroups_act_order_g_idx():
    u = _unpacked(64, 64, gs=16)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    u.g_idx = u.g_idx[perm].contiguous()  # column c belongs to group g_idx[c], columns scattered
    q = QuantLinear.from_unpacked(u, torch.float32)
    x = torch.randn(4, 64)
    torch.testing.assert_close(q(x), x @ u.dequantize().t(), rtol=1e-4, atol=1e-4)


# ---- the CLI on a tiny random model (no tokenizer: calibration from prompt_token_ids) ----

TINY = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_dir(d, calib_rows: int):
    """The TINY model with fixed random weights in folder `d`, plus `calib_rows` token-id rows."""
    from safetensors.torch import save_file

    from llmctl.models.config import ModelConfig
    from llmctl.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_dict(TINY))
    state = {
        k: (1 + 0.1 * torch.rand_like(v)) if "norm" in k else torch.randn_like(v) * 0.08
        for k, v in model.state_dict().items()
    }
    save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(TINY))
    g = torch.Generator().manual_seed(1)
    rows = [
        {"prompt_token_ids": torch.randint(3, 97, (40,), generator=g).tolist()}
        for _ in range(calib_rows)
    ]
    (d / "calib.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_dir(tmp_path_factory.mktemp("tiny"), calib_rows=40)


def _quantize(tiny_dir, out, *extra):
    report = out.parent / f"{out.name}.json"
    rc = main(
        [
            "quantize",
            str(tiny_dir),
            "-o",
            str(out),
            "--group-size",
            "32",
            "--calib",
            str(tiny_dir / "calib.jsonl"),
            "--num-samples",
            "8",
            "--seq-len",
            "32",
            "--report-json",
            str(report),
            "--quiet",
            *extra,
        ]
    )
    return rc, (json.loads(report.read_text()) if report.exists() else None)


@pytest.mark.parametrize(
    "fmt,method", [("compressed-tensors", "--gptq"), ("awq", "--awq"), ("gptq", "--rtn")]
)
def test_quantize_cli_writes_a_folder_the_loader_runs_packed(tiny_dir, tmp_path, fmt, method):
    out = tmp_path / "q"
    rc, report = _quantize(tiny_dir, out, method, "--format", fmt)
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == fmt and cfg["hidden_size"] == 64
    assert (out / "recipe.yaml").read_text().count(f"method: {method[2:]}") == 1
    assert not (out / ".llmctl-work").exists()
    assert report["method"] == method[2:] and len(report["layers"]) == 14
    assert report["size_after_bytes"] < report["size_before_bytes"]
    assert report["perplexity_before"] > 1 and report["perplexity_after"] > 1
    model, _ = load_model(out, "float32", "cpu")
    assert isinstance(model.model.layers[1].mlp.down_proj, QuantLinear)
    # reference: a dense model holding the file's dequantized weights (and AWQ's folded norms)
    _, linears, tensors = read_quantized(out)
    ref, _ = load_model(tiny_dir, "float32", "cpu")
    ref.load_state_dict({**tensors, **{f"{n}.weight": u.dequantize() for n, u in linears.items()}})
    orig, _ = load_model(tiny_dir, "float32", "cpu")
    for length in (8, 48):  # int4 kernel path (<= 32 tokens) and dequantize path
        ids = torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(length))
        a = model.forward_dense(ids)
        if length <= QuantLinear.SMALL_BATCH_TOKENS:  # the int4 kernel rounds float32 rows to bf16
            assert _rel(a, ref.forward_dense(ids)) < 1e-2
        else:
            torch.testing.assert_close(a, ref.forward_dense(ids), rtol=1e-4, atol=1e-4)
        b = orig.forward_dense(ids)
        assert _rel(a, b) < 0.5  # 4-bit of random weights: near, not equal


def test_quantize_cli_refuses_group_size_that_does_not_divide(tiny_dir, tmp_path, capsys):
    rc, _ = _quantize(tiny_dir, tmp_path / "bad", "--gptq", "--group-size", "64")
    assert rc == 2
    err = capsys.readouterr().err
    assert "model.layers.0.mlp.down_proj: 96 input features" in err
    assert "work for every layer: 16, 32" in err
    assert not (tmp_path / "bad").exists()  # refused before anything was created
    assert main(["quantize", str(tiny_dir), "-o", str(tmp_path / "x"), "--gptq", "--awq"]) == 2


def test_transformers_loads_our_compressed_tensors_output_with_matching_logits(tiny_dir, tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ct"
    # symmetric: transformers cannot load asymmetric pack-quantized files with this
    # compressed-tensors (its meta-device path expects an unpacked zero point;
    # vllm-project/llm-compressor#1618)
    rc, _ = _quantize(tiny_dir, out, "--gptq", "--symmetric")
    assert rc == 0
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours, _ = load_model(out, "float32", "cpu")
    for length in (8, 48):  # int4 kernel path (<= 32 tokens) and dequantize path
        ids = torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            ref = hf(ids).logits.float()
        if length <= QuantLinear.SMALL_BATCH_TOKENS:  # the int4 kernel rounds float32 rows to bf16
            assert _rel(ours.forward_dense(ids), ref) < 1e-2
        else:
            torch.testing.assert_close(ours.forward_dense(ids), ref, rtol=1e-3, atol=1e-3)


class _Tok:
    def encode(self, text):
        return [ord(c) % 50 for c in text]

    def apply_chat_template(self, messages):
        return [99] + [t for m in messages for t in self.encode(m["content"])]


def test_calibration_readers_and_default(tmp_path):
    tok = _Tok()
    rows = [
        {"prompt": "abc"},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"prompt_token_ids": [7, 8]},
        {"text": "z"},
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert read_token_stream(tmp_path / "c.jsonl", tok, separator=0) == [
        47,
        48,
        49,
        0,
        99,
        4,
        5,
        0,
        7,
        8,
        0,
        22,
        0,
    ]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["ab", "c"]}), tmp_path / "c.parquet")
    assert read_token_stream(tmp_path / "c.parquet", tok) == [47, 48, 49]
    (tmp_path / "bad.jsonl").write_text('{"foo": 1}\n')
    with pytest.raises(UsageError, match="bad.jsonl:1: no usable field"):
        read_token_stream(tmp_path / "bad.jsonl", tok)
    ids, warnings = cut_sequences(list(range(100)), 3, 10)
    assert ids.shape == (3, 10) and ids[0, 0] == 0 and ids[-1, 0] == 90 and not warnings
    calib = load_calibration(None, tok, num_samples=4, seq_len=64)
    assert (
        "built-in" in calib.warnings[0]
        and calib.input_ids.shape == (4, 64)
        and calib.heldout.numel() > 64
    )


def test_built_in_calibration_warning_only_where_data_is_calibrated_on(tmp_path):
    """Without --calib the built-in text is used; RTN reads only weights, so only GPTQ gets the
    warning."""
    from llmctl.compress.calib_data import DEFAULT_WARNING
    from llmctl.runtime.resolve import resolve_model_path

    DEMO = resolve_model_path(
        None
    )  # the embedded demo model (it has a tokenizer for the built-in text)

    warnings = {}
    for method in ("--rtn", "--gptq"):
        report = tmp_path / f"{method[2:]}.json"
        rc = main(
            [
                "quantize",
                str(DEMO),
                "-o",
                str(tmp_path / method[2:]),
                method,
                "--group-size",
                "32",
                "--num-samples",
                "2",
                "--seq-len",
                "32",
                "--report-json",
                str(report),
                "--quiet",
            ]
        )
        assert rc == 0
        r = json.loads(report.read_text())
        warnings[method] = r["warnings"]
        assert r["perplexity_before"] > 1 and "windows of 256" in r["perplexity_method"]
    assert DEFAULT_WARNING not in warnings["--rtn"] and DEFAULT_WARNING in warnings["--gptq"]


def test_quantized_checkpoint_is_read_through_its_safetensors_index(tiny_dir, tmp_path):
    """One weight path for dense and quantized folders: shards named by the index, nothing else
    (a stale *.safetensors beside them is not read)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "q"
    assert _quantize(tiny_dir, out, "--rtn", "--format", "gptq")[0] == 0
    single, _ = load_model(out, "float32", "cpu")
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(out / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({"stale.weight": torch.zeros(2)}, str(out / "stale.safetensors"))
    sharded, _ = load_model(out, "float32", "cpu")
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        sharded.forward_dense(ids), single.forward_dense(ids), rtol=0, atol=0
    )
