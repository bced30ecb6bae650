"""Batch invariance (issue 20): with `batch_invariant=True` every token of a row is bit-identical
to the row run alone, whatever other rows share its steps, however its prompt is chunked, whether
its prefix came from the cache, whether it was preempted and recomputed and whether (greedy)
speculative decoding is on; seeded sampled rows too, without speculation. A property test over
random mixes, in float32 and bfloat16; besides the tokens it compares the logits each step
computes for a row's real context, bit for bit (a float32 argmax rarely flips on a last-bit
difference, so tokens alone would prove little there).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl import LLM, SamplingParams
from llmctl.engine.config import EngineConfig
from llmctl.engine.model_runner import ModelRunner
from llmctl.errors import UsageError
from tests.conftest import make_random_model

MAX_NEW = 8
NUM_ROWS = 8


def _rows(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 1-40 tokens, three sharing a 24-token prefix (prefix-cache hits), six greedy
    and two sampled with a seed."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, vocab, (24,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 7, 19, 40, 12)]
    prompts += [shared + [5, 6], shared + [9] * 9, shared[:]]
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    rows = [(p, greedy) for p in prompts]
    for i in (2, 6):
        rows[i] = (
            rows[i][0],
            SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=i + 1, ignore_eos=True),
        )
    return rows


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model_path(request, tmp_path_factory):
    # qwen2: q/k/v biases; qwen3: q/k RMSNorm. An intermediate size that is no multiple of the
    # vector width, so tails of the elementwise and linear kernels are exercised.
    folder = tmp_path_factory.mktemp(request.param)
    return make_random_model(folder, request.param, seed=7, intermediate_size=88)


_ALONE: dict = {}


KV_BYTES = 4 * 1024**2
# 128 tokens of K/V for these models (2 layers x 2 KV heads x 16 x K and V x 4 bytes a token): a
# mix of long rows runs out of blocks, so some are preempted and recomputed.
SMALL_KV_BYTES = 128 * 512


# LLMCTL_TEST_DEVICE=cuda runs these checks on a GPU (benchmarks/gpu_check.sh), through the
# Triton kernels of kernels/cuda/invariant.py and the decode CUDA graphs.
DEVICE = os.environ.get("LLMCTL_TEST_DEVICE", "cpu")


def _llm(path, dtype: str, kv_cache_memory: int = KV_BYTES, **kw) -> LLM:
    return LLM(str(path), dtype=dtype, device=DEVICE, kv_cache_memory=kv_cache_memory, **kw)


def _generate(llm: LLM, rows: list, order: list[int]) -> tuple[dict, dict]:
    """Rows `order` generated together: (row -> tokens, (row, context) -> logits [V]).
    Logged logits: each sampling sequence's first row of a step, the one whose context is all real
    tokens (the rows after it score speculative drafts)."""
    runner, logged = llm.engine.runner, {}
    execute = runner.execute

    def logging_execute(batch):
        logits, sampling, prompt = execute(batch)
        row = 0
        for seq in sampling:
            logged[(order[int(seq.request_id)], tuple(seq.token_ids))] = logits[row].clone()
            row += 1 + len(seq.spec_token_ids)
        return logits, sampling, prompt

    runner.execute = logging_execute
    try:
        outs = llm.generate([rows[i][0] for i in order], [rows[i][1] for i in order])
    finally:
        runner.execute = execute
    return {i: o.output_token_ids for i, o in zip(order, outs)}, logged


def alone(path, dtype: str, invariant: bool = True) -> tuple[dict, dict]:
    """Each row run by itself: its whole prompt in one chunk, nothing cached, no speculation."""
    key = (str(path), dtype, invariant)
    if key not in _ALONE:
        rows, tokens, logits = _rows(160), {}, {}
        for i in range(len(rows)):
            llm = _llm(path, dtype, batch_invariant=invariant, enable_prefix_caching=False)
            t, g = _generate(llm, rows, [i])
            tokens.update(t)
            logits.update(g)
        _ALONE[key] = tokens, logits
    return _ALONE[key]


def mixed(path, dtype: str, mix: dict, invariant: bool = True) -> tuple[dict, dict]:
    """Rows `mix["order"]` run together under the drawn engine settings (see `_generate`)."""
    rows = _rows(160)
    llm = _llm(
        path,
        dtype,
        batch_invariant=invariant,
        block_size=mix["block_size"],
        max_num_batched_tokens=mix["budget"],
        enable_prefix_caching=mix["prefix_cache"],
        speculative="ngram" if mix["speculate"] else None,
        num_speculative_tokens=3,
        kv_cache_memory=SMALL_KV_BYTES if mix.get("small_kv") else KV_BYTES,
    )
    if mix["warm"]:  # a first pass fills the prefix cache with every prompt's full blocks
        llm.generate([rows[i][0] for i in mix["order"]], SamplingParams(max_tokens=1))
    return _generate(llm, rows, mix["order"])


MIXES = st.fixed_dictionaries(
    {
        "order": st.lists(st.integers(0, NUM_ROWS - 1), min_size=1, max_size=NUM_ROWS, unique=True),
        "budget": st.sampled_from([3, 8, 13, 32, 512]),
        "block_size": st.sampled_from([1, 4, 16]),
        "prefix_cache": st.booleans(),
        "warm": st.booleans(),
        "speculate": st.booleans(),
        "small_kv": st.booleans(),
    }
)


def _check(path, dtype: str, mix: dict, invariant: bool = True) -> list:
    """Rows whose tokens differ from the row run alone (sampled rows only without speculation),
    then the (row, context length) whose logits differ in any bit."""
    (ref, ref_logits), (got, got_logits) = (
        alone(path, dtype, invariant),
        mixed(path, dtype, mix, invariant),
    )
    rows = _rows(160)
    bad: list = [
        i
        for i, tokens in got.items()
        if (rows[i][1].greedy or not mix["speculate"]) and tokens != ref[i]
    ]
    shared = sorted(set(ref_logits) & set(got_logits))
    assert shared, "no step compared"
    return bad + [
        (k[0], len(k[1])) for k in shared if not torch.equal(ref_logits[k], got_logits[k])
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(
    max_examples=12,
    deadline=None,
    database=None,
)
@given(mix=MIXES)
def test_every_row_equals_the_row_run_alone(model_path, dtype, mix):
    assert _check(model_path, dtype, mix) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_engine_is_not_batch_invariant(model_path, dtype):
    """Why the switch exists: without it, batching and chunking change some row's logits in at
    least one of these mixes (BLAS and SDPA reduce in an order that depends on the batch)."""
    mixes = [
        dict(
            order=list(range(NUM_ROWS)),
            budget=b,
            block_size=16,
            prefix_cache=c,
            warm=c,
            speculate=False,
        )
        for b in (3, 13, 512)
        for c in (False, True)
    ]
    assert any(_check(model_path, dtype, m, invariant=False) for m in mixes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_without_the_c_kernels_rows_still_equal_the_row_run_alone(model_path, dtype, monkeypatch):
    """No C kernels (as with no C compiler): linears, the MLP and attention take the
    one-row-per-call references."""
    monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0,native=0")
    _ALONE.clear()  # references computed with the C kernels do not apply here
    try:
        for mix in (
            dict(
                order=[3, 0, 5, 6],
                budget=8,
                block_size=4,
                prefix_cache=True,
                warm=True,
                speculate=False,
            ),
            dict(
                order=[7, 1, 4, 3],
                budget=13,
                block_size=1,
                prefix_cache=False,
                warm=False,
                speculate=True,
            ),
        ):
            assert _check(model_path, dtype, mix) == []
    finally:
        _ALONE.clear()


def test_batch_invariant_off_the_cpu_needs_cuda_and_triton(model_path, monkeypatch):
    """CUDA runs take the Triton kernels (kernels/cuda/invariant.py): without triton, or on a
    device they do not serve, the engine says so up front."""
    from llmctl.engine import model_runner
    from llmctl.models.config import ModelConfig

    config = ModelConfig.from_file(model_path / "config.json")
    with pytest.raises(UsageError, match="CUDA with triton"):
        ModelRunner(None, config, EngineConfig(batch_invariant=True), "mps", torch.bfloat16)
    monkeypatch.setattr(model_runner, "_triton_importable", lambda: False)
    with pytest.raises(UsageError, match="CUDA with triton"):
        ModelRunner(None, config, EngineConfig(batch_invariant=True), "cuda", torch.bfloat16)


def _with_quantized_q_proj(llm: LLM) -> LLM:
    """q_proj of every layer as a 4-bit QuantLinear, whose kernel choice depends on the row count
    (the int4 kernel for few rows, dequantize + matmul for many)."""
    from llmctl.models.qlinear import QuantLinear
    from tests.test_quant_engine import _unpacked

    for i, layer in enumerate(llm.runtime.model.layers):
        q = QuantLinear.from_unpacked(_unpacked(64, 64, seed=i), llm.runtime.dtype)
        layer.self_attn.q_proj = q
    return llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_layers_are_served_one_row_a_call(model_path, dtype):
    rows, order = _rows(160), [3, 7, 0, 5, 1]
    ref_tokens, ref_logits = {}, {}
    for i in order:
        llm = _with_quantized_q_proj(_llm(model_path, dtype, batch_invariant=True))
        t, g = _generate(llm, rows, [i])
        ref_tokens.update(t)
        ref_logits.update(g)
    llm = _llm(model_path, dtype, batch_invariant=True, max_num_batched_tokens=40)
    tokens, logits = _generate(_with_quantized_q_proj(llm), rows, order)
    assert tokens == ref_tokens
    assert all(torch.equal(logits[k], ref_logits[k]) for k in set(logits) & set(ref_logits))
