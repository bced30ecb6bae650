"""The KV cache's dtype (issue 38, `--kv-cache-dtype`): fp8 caches (e4m3fn, e5m2) written
saturated, read as bytes by the C decode kernels, which equal the same kernels over the cache
widened to bf16 or float32 bit for bit; an engine on an fp8 cache equals, logit for logit, an
engine on a float32 cache holding the same fp8-rounded values; prefix caching, chunked prefill,
preemption, speculation and batch invariance on it; twice the tokens in the same memory; the
command line and the vLLM backend.
"""

from __future__ import annotations

import json

import pytest
import torch

from llmctl import LLM, SamplingParams
from llmctl.engine.config import EngineConfig
from llmctl.errors import UsageError
from llmctl.kernels import attention as attention_module
from llmctl.kernels import attention_features
from llmctl.kernels import kv_dtype as kv
from llmctl.kernels.attention import decode_attention, write_kv
from llmctl.kernels.cpu import attention as cpu_attention
from tests.conftest import make_random_model

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
QUANTIZED = [*FP8, torch.int8]


def _filled_caches(dtype, kvh=2, d=64, bs=16, nblocks=40, lens=(1, 17, 100, 250, 37), seed=0):
    """Caches [kvh, nblocks * bs, d] of `dtype` holding random K (std 3) and V for sequences of
    `lens` on shuffled blocks: (k_cache, v_cache, tables [B, 16], lens [B])."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.zeros(kvh, nblocks * bs, kv.row_width(d, dtype), dtype=dtype)
    vc = torch.zeros_like(kc)
    tables = torch.stack([torch.randperm(nblocks, generator=g)[:16] for _ in lens])
    for b, n in enumerate(lens):
        slots = (tables[b, : -(-n // bs), None] * bs + torch.arange(bs)).flatten()[:n]
        k = torch.randn(n, kvh, d, generator=g) * 3
        write_kv(kc, vc, k, torch.randn(n, kvh, d, generator=g), slots)
    return kc, vc, tables, torch.tensor(lens)


def test_cache_dtype_names_follow_vllm():
    assert kv.cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv.cache_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert kv.cache_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    assert kv.cache_dtype("fp8_e5m2", torch.float32) is torch.float8_e5m2
    assert kv.cache_dtype("int8", torch.float32) is torch.int8
    assert kv.row_width(64, torch.int8) == 68 and kv.row_width(64, torch.float8_e5m2) == 64
    with pytest.raises(ValueError, match="fp8_e5m2"):
        kv.cache_dtype("int4", torch.float32)
    with pytest.raises(UsageError, match="--kv-cache-dtype 'fp9'"):
        EngineConfig(kv_cache_dtype="fp9")


@pytest.mark.parametrize("dtype", FP8)
def test_writes_saturate_and_the_c_write_equals_torchs(dtype):
    """16 rows or more take the C write (bytes of what `to_cache` made), fewer index_copy_ on
    uint8 views: the same bytes. Out-of-range values saturate instead of becoming NaN or inf."""
    top = 448.0 if dtype is torch.float8_e4m3fn else 57344.0
    x = torch.randn(20, 2, 16) * 3
    x[0, 0, :4] = torch.tensor([1e6, -1e6, top * 1.01, 0.0])
    slots = torch.randperm(64)[:20]
    c_k, c_v = torch.zeros(2, 64, 16, dtype=dtype), torch.zeros(2, 64, 16, dtype=dtype)
    write_kv(c_k, c_v, x, -x, slots)
    t_k, t_v = torch.zeros_like(c_k), torch.zeros_like(c_v)
    for i in range(0, 20, 5):  # 5 rows a call: the PyTorch path
        write_kv(t_k, t_v, x[i : i + 5], -x[i : i + 5], slots[i : i + 5])
    assert torch.equal(c_k.view(torch.uint8), t_k.view(torch.uint8))
    assert torch.equal(c_v.view(torch.uint8), t_v.view(torch.uint8))
    first = c_k[0, slots[0], :4].float()
    assert first.tolist() == [top, -top, top, 0.0]
    assert torch.isfinite(c_v.float()).all()
    expect = x.clamp(-top, top).to(dtype).float()
    assert torch.equal(c_k[:, slots].transpose(0, 1).float(), expect)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", FP8)
def test_the_c_fp8_conversions_equal_torchs_for_every_value(dtype, half):
    """`native` to_cache and widen (C table lookups) give torch's codes and values for every
    16-bit pattern (NaN, inf, saturation, subnormals) and every fp8 code, also over a column
    slice of a wider tensor, the q/k/v output's layout."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(half).view(512, 2, 64)
    if cpu_attention.load("core") is None:
        pytest.skip("no C compiler: the PyTorch casts serve")
    assert kv._lut(every, dtype, narrow=True) is not None  # the C lookup, not the fallback
    want = kv.to_cache(every, dtype).view(torch.uint8)
    assert torch.equal(kv.to_cache(every, dtype, native=True).view(torch.uint8), want)
    wide = torch.cat((every, every), dim=-1)[..., 64:]  # strided rows, contiguous heads
    assert not wide.is_contiguous()
    assert torch.equal(kv.to_cache(wide, dtype, native=True).view(torch.uint8), want)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).view(4, 64)
    got = kv.widen(codes, half, native=True)
    assert got.dtype is half and torch.equal(
        got.view(torch.int16), codes.to(half).view(torch.int16)
    )
    gathered = torch.cat((codes, codes)).view(2, 4, 64).transpose(0, 1)  # not row-contiguous
    bits = kv.widen(gathered, half, native=True).view(torch.int16)
    assert torch.equal(bits, gathered.to(half).view(torch.int16))


def test_int8_rows_carry_their_scale_and_the_c_write_equals_torchs():
    """int8: each (token, head) row is D values over amax / 127 then the scale's 4 bytes; the C
    write (which quantizes itself, float32 or bf16 rows) and to_cache + index_copy_ store the
    same bytes; widen gives the values back within half a step."""
    x = torch.randn(20, 2, 16) * 3
    x[0, 0] = 0.0  # an all-zero row: no division by zero
    x[1, 0, :2] = torch.tensor([1.5, -2.5]) * x[1, 0].abs().max() / 127  # ties: to even
    slots = torch.randperm(64)[:20]
    for rows in (x, x.bfloat16()):
        c_k, c_v = (
            torch.zeros(2, 64, 20, dtype=torch.int8),
            torch.zeros(2, 64, 20, dtype=torch.int8),
        )
        assert cpu_attention.use_write_kv_i8(c_k, c_v, rows, -rows, slots)
        write_kv(c_k, c_v, rows, -rows, slots)
        t_k, t_v = torch.zeros_like(c_k), torch.zeros_like(c_v)
        kv.write_rows(t_k, slots, rows)
        kv.write_rows(t_v, slots, -rows)
        assert torch.equal(c_k, t_k) and torch.equal(c_v, t_v)
    c_k = torch.zeros(2, 64, 20, dtype=torch.int8)
    write_kv(c_k, torch.zeros_like(c_k), x, -x, slots)
    rows = c_k[:, slots].transpose(0, 1)  # [20, 2, 20]
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127
    assert torch.equal(rows[..., 16:].contiguous().view(torch.float32), scale)
    back = kv.widen(rows, torch.float32)
    assert back.shape == x.shape and (back - x).abs().le(scale / 2 + 1e-6).all()
    assert rows[0, 0, :16].eq(0).all() and rows[..., :16].abs().max() == 127


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("d, group", [(64, 3), (128, 8), (48, 1), (64, 12)])
def test_quantized_decode_kernels_equal_the_widened_cache_bit_for_bit(dtype, d, group):
    """The kernels widen rows as kv_dtype.widen does (fp8 exactly; int8 times its row's scale,
    rounded once), so they must give exactly what the bf16 kernels give over the cache widened
    to bf16 (the vdpbf16ps kernel, bf16 query) and the float32 kernel over it widened to float32
    (float32 query); and both near the reference."""
    kc, vc, tables, lens = _filled_caches(dtype, d=d)
    q = torch.randn(len(lens), 2 * group, d)
    args = (tables, lens, 0.125, 16, int(lens.max()))
    out = cpu_attention.paged_decode_attention(q, kc, vc, *args, "generic")
    kf, vf = kv.widen(kc, torch.float32), kv.widen(vc, torch.float32)
    wide = cpu_attention.paged_decode_attention(q, kf, vf, *args, "generic")
    assert cpu_attention.decode_kernel(torch.float32, dtype) == f"paged_decode_{_fmt(dtype)}"
    assert torch.equal(out, wide)
    ref = decode_attention(q, kc, vc, tables, lens, 0.125, 16)  # the PyTorch reference
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if not cpu_attention.dpbf16_available():
        return
    qb = q.bfloat16()
    assert cpu_attention.decode_kernel(torch.bfloat16, dtype).startswith("paged_decode_dpbf16_")
    fast = cpu_attention.paged_decode_attention(qb, kc, vc, *args)
    kb, vb = kv.widen(kc, torch.bfloat16), kv.widen(vc, torch.bfloat16)
    slow = cpu_attention.paged_decode_attention(qb, kb, vb, *args, "dpbf16")
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("dtype", FP8)
def test_the_generic_fp8_kernel_reads_every_finite_code_exactly(dtype):
    """Every finite fp8 code (subnormals, zeros of both signs, the largest values) in K and V:
    the generic kernel's own conversion equals the cache widened to float32 by torch."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[torch.isfinite(codes.view(dtype).float())]  # [n]
    d, bs, kvh = 64, 16, 2
    n_tok = 32  # 2,048 values: every code 8 times, at different columns
    rows = finite.repeat(-(-n_tok * d // finite.numel()))[: n_tok * d].view(n_tok, d)
    kc = torch.zeros(kvh, n_tok, d, dtype=torch.uint8)
    kc[:] = rows
    vc = kc.flip(1).contiguous()
    kc, vc = kc.view(dtype), vc.view(dtype)
    tables = torch.arange(n_tok // bs).view(1, -1)
    lens = torch.tensor([n_tok])
    q = torch.randn(1, 2 * kvh, d) * 1e-3  # small scores: the softmax keeps every V row
    args = (tables, lens, 0.125, bs, n_tok)
    out = cpu_attention.paged_decode_attention(q, kc, vc, *args, "generic")
    kf, vf = kv.widen(kc, torch.float32), kv.widen(vc, torch.float32)
    assert torch.isfinite(kf).all() and kf.abs().min() == 0 and kf.abs().max() > 400
    assert torch.equal(out, cpu_attention.paged_decode_attention(q, kf, vf, *args, "generic"))


def _fmt(dtype) -> str:
    return {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.int8: "i8"}[dtype]


def test_the_same_memory_holds_twice_the_tokens():
    cfg = dict(kv_cache_memory=1 << 20)
    bf16 = LLM("llmctl/data/demo-model", dtype="bfloat16", **cfg).engine.runner
    fp8 = LLM("llmctl/data/demo-model", dtype="bfloat16", kv_cache_dtype="fp8", **cfg).engine.runner
    assert 2 * fp8.bytes_per_block == bf16.bytes_per_block
    assert fp8.num_blocks == (1 << 20) // fp8.bytes_per_block >= 2 * bf16.num_blocks
    i8 = LLM("llmctl/data/demo-model", dtype="bfloat16", kv_cache_dtype="int8", **cfg).engine.runner
    d = bf16.kv_caches[0][0].shape[-1]
    assert i8.kv_caches[0][0].shape[-1] == d + 4  # each row's scale
    assert i8.bytes_per_block * 2 * d == bf16.bytes_per_block * (d + 4)
    assert fp8.kv_caches[0][0].dtype is torch.float8_e4m3fn
    assert fp8.kv_cache_bytes <= 1 << 20


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=3)


def _rows(vocab=160, n=6):
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, vocab, (24,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (m,), generator=g).tolist() for m in (3, 19, 40)]
    prompts += [shared + [5, 6], shared + [9] * 9, shared[:]]
    return prompts[:n], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)


def _run(path, rows, **engine):
    prompts, params = rows
    outs = LLM(str(path), dtype="float32", **engine).generate(prompts, params)
    return [o.outputs[0] for o in outs]


def _rounded(dtype):
    """to_cache that rounds K/V through `dtype` and back to float32: a float32 cache holding
    exactly the values an fp8 cache holds."""
    real = kv.to_cache

    def to_cache(x, cache_dtype, native=False):
        if cache_dtype is torch.float32:
            return kv.widen(real(x, dtype), torch.float32)
        return real(x, cache_dtype, native)

    return to_cache


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):  # a window of 8, attention and final-logit soft-capping
    return make_random_model(tmp_path_factory.mktemp("gemma2"), "gemma2", seed=3)


@pytest.mark.parametrize(
    "arch, name, impl",
    [
        ("qwen3", "fp8", "auto"),
        ("qwen3", "fp8_e5m2", "auto"),
        ("qwen3", "int8", "auto"),
        ("gemma2", "int8", "auto"),
        ("qwen3", "fp8", "transformers"),  # transformers' modeling code on our cache
        ("gemma2", "fp8", "auto"),  # kernels/attention_features.py: windows and soft-capping
    ],
)
def test_an_fp8_engine_equals_a_float32_cache_of_the_rounded_values(
    request, arch, name, impl, monkeypatch
):
    """Logprobs equal to the last bit: the fp8 cache changes what is stored, nothing else."""
    path, rows = request.getfixturevalue(arch), _rows()
    engine = dict(enable_prefix_caching=False, model_impl=impl)
    fp8 = _run(path, rows, kv_cache_dtype=name, **engine)
    exact = _run(path, rows, **engine)
    dtype = kv.cache_dtype(name, torch.float32)
    for module in (attention_module, attention_features):
        monkeypatch.setattr(module, "to_cache", _rounded(dtype))
    wide = _run(path, rows, **engine)
    assert [o.token_ids for o in fp8] == [o.token_ids for o in wide]
    assert [o.logprobs for o in fp8] == [o.logprobs for o in wide]
    assert [o.logprobs for o in exact] != [o.logprobs for o in wide]  # rounding changes something


@pytest.mark.parametrize(
    "engine",
    [
        dict(max_num_batched_tokens=5),  # chunked prefill
        dict(block_size=4, kv_cache_memory=96 * 2 * 2 * 2 * 16),  # preemption: 96 tokens of K/V
        dict(speculative="ngram", num_speculative_tokens=3),
        dict(enable_prefix_caching=True, block_size=4),  # the shared prefix hits
    ],
    ids=["chunked", "preempted", "ngram", "prefix-cache"],
)
@pytest.mark.parametrize("cache", ["fp8", "int8"])
def test_engine_features_on_a_quantized_cache_keep_the_tokens(qwen3, engine, cache):
    """Prompts attend over K/V as the cache holds them, so chunking a prompt, recomputing it after
    preemption or reading its prefix from the cache gives the tokens of the plain run."""
    rows = _rows()
    plain = _run(qwen3, rows, kv_cache_dtype=cache, enable_prefix_caching=False)
    llm = LLM(str(qwen3), dtype="float32", kv_cache_dtype=cache, **engine)
    if engine.get("enable_prefix_caching"):
        llm.generate(rows[0], SamplingParams(max_tokens=1))  # fill the prefix cache
    outs = [o.outputs[0] for o in llm.generate(*rows)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    if "kv_cache_memory" in engine:
        assert llm.engine.scheduler.num_preemptions > 0
    if engine.get("enable_prefix_caching"):
        assert llm.engine.block_manager.prefix_hits > 0


@pytest.mark.parametrize("cache", ["fp8", "int8"])
def test_batch_invariance_holds_on_a_quantized_cache(qwen3, cache):
    """Each row alone equals the rows together, chunked, on small blocks, bit for bit."""
    prompts, params = _rows()
    together = LLM(
        str(qwen3), dtype="bfloat16", kv_cache_dtype=cache, batch_invariant=True,
        max_num_batched_tokens=7, block_size=4,
    ).generate(prompts, params)  # fmt: skip
    for prompt, out in zip(prompts, together):
        alone = LLM(
            str(qwen3), dtype="bfloat16", kv_cache_dtype=cache, batch_invariant=True,
            enable_prefix_caching=False,
        ).generate([prompt], params)[0]  # fmt: skip
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert alone.outputs[0].logprobs == out.outputs[0].logprobs


def test_run_batch_takes_the_flag_and_refuses_a_bad_value(tmp_path, capsys):
    from llmctl.cli import main

    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "To be", "max_tokens": 4}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", str(rows), "-o", str(out), "--kv-cache-dtype", "fp8", "-q"]) == 0
    row = json.loads(out.read_text())
    assert row["error"] is None and row["usage"]["completion_tokens"] == 4
    capsys.readouterr()
    bad = ["run-batch", str(rows), "-o", str(tmp_path / "b.jsonl"), "--kv-cache-dtype", "fp7"]
    assert main(bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kv-cache-dtype 'fp7'" in err[0]
    assert not (tmp_path / "b.jsonl").exists()


def test_the_vllm_backend_gets_the_same_name():
    from llmctl.batch.backends import vllm_engine_args

    assert vllm_engine_args({"kv_cache_dtype": "fp8"}, {})["kv_cache_dtype"] == "fp8"
