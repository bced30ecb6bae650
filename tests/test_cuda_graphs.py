"""Decode steps through static, padded buffers (what a CUDA graph replays) give the same tokens as
the engine's per-step tensors; on CUDA, through real captured graphs.

On the CPU the buffers run eagerly (`use_graphs=False`): that checks the padding (scratch block,
length-1 rows), the fixed-width block tables and the output slicing, which a replay shares.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmctl import LLM, SamplingParams
from llmctl.engine.cuda_graphs import GRAPH_BATCH_SIZES, graph_sizes, padded_size
from llmctl.models.config import ModelConfig
from tests.conftest import make_random_model
from tests.test_engine_exactness import random_prompts


def test_graph_sizes_cover_every_batch_up_to_max_num_seqs():
    assert graph_sizes(5) == (1, 2, 4, 5)
    assert graph_sizes(256) == GRAPH_BATCH_SIZES
    assert graph_sizes(1000)[-1] == 256
    sizes = graph_sizes(100)
    for n in range(1, 101):
        b = padded_size(sizes, n)
        assert b >= n and all(s < n for s in sizes if s < b)
    assert padded_size(sizes, 101) is None


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("llama"), "llama", seed=3)


def _generate(path, device, dtype, static: str, prompts, params, **kw):
    """static: "off" (per-step tensors), "eager" (static buffers, no graph), "graph" (CUDA
    graphs)."""
    llm = LLM(
        str(path), dtype=dtype, device=device, kv_cache_memory=8 * 1024**2, cuda_graphs=False, **kw
    )
    engine = llm.engine
    if static != "off":
        engine.runner.enable_decode_graphs(
            engine.engine_config.max_num_seqs, engine.capacity, use_graphs=static == "graph"
        )
    outs = [o.output_token_ids for o in llm.generate(prompts, params)]
    return outs, engine.runner.graphs


@pytest.mark.parametrize(
    "kw", [{"max_num_seqs": 5}, {"max_num_seqs": 7, "block_size": 4}, {"max_num_seqs": 256}]
)
def test_static_decode_buffers_give_the_same_tokens(llama, kw):
    prompts = random_prompts(160)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref, _ = _generate(llama, "cpu", "float32", "off", prompts, greedy, **kw)
    out, graphs = _generate(llama, "cpu", "float32", "eager", prompts, greedy, **kw)
    assert out == ref
    assert graphs.replays > 0  # decode-only steps did go through the buffers


def test_static_decode_buffers_same_samples_in_bfloat16(llama):
    prompts = random_prompts(160, seed=1)
    sampled = SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=5, ignore_eos=True)
    ref, _ = _generate(llama, "cpu", "bfloat16", "off", prompts, sampled, max_num_seqs=6)
    out, graphs = _generate(llama, "cpu", "bfloat16", "eager", prompts, sampled, max_num_seqs=6)
    assert out == ref and graphs.replays > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_static_decode_buffers_keep_batch_invariant_mode(llama, dtype):
    """Padded static batches (graph sizes) still take the fixed-order paths: the same tokens and
    logits as the batch-invariant engine without them."""
    prompts = random_prompts(160, seed=2)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kw = dict(max_num_seqs=5, batch_invariant=True)
    ref, _ = _generate(llama, "cpu", dtype, "off", prompts, greedy, **kw)
    out, graphs = _generate(llama, "cpu", dtype, "eager", prompts, greedy, **kw)
    assert graphs.batch_invariant and graphs.replays > 0
    assert graphs._meta(3, 7).batch_invariant
    assert out == ref


def test_engine_turns_graphs_on_only_on_cuda(llama):
    llm = LLM(str(llama), dtype="float32", device="cpu", kv_cache_memory=8 * 1024**2)
    assert llm.engine.engine_config.cuda_graphs and llm.engine.runner.graphs is None


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh runs it)"
)
def test_captured_graphs_match_eager_on_cuda(llama):
    pytest.importorskip("triton")
    prompts = random_prompts(160)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref, _ = _generate(llama, "cuda", "float32", "off", prompts, greedy, max_num_seqs=7)
    out, graphs = _generate(llama, "cuda", "float32", "graph", prompts, greedy, max_num_seqs=7)
    assert out == ref
    assert graphs.graphs and graphs.replays > 0


def test_graphs_only_for_cuda_models_of_plain_weights():
    from llmctl.engine.cuda_graphs import graphs_supported as _graphs_supported

    class Wrapped(torch.Tensor):  # stands in for the 2:4 SparseSemiStructuredTensor subclass
        pass

    plain = torch.nn.Linear(4, 4)
    sparse = torch.nn.Linear(4, 4)
    sparse.weight = torch.nn.Parameter(torch.randn(4, 4).as_subclass(Wrapped), requires_grad=False)
    config = ModelConfig.from_dict(
        dict(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
             num_hidden_layers=2, num_attention_heads=2)
    )  # fmt: skip
    assert not _graphs_supported(plain, config, "cpu")
    assert not _graphs_supported(sparse, config, "cuda")
    try:
        import triton  # noqa: F401
    except ImportError:
        assert not _graphs_supported(plain, config, "cuda:0")
    else:
        assert _graphs_supported(plain, config, "cuda:0")
    windowed = dataclasses.replace(config, layer_windows=(8,) * config.num_layers)
    assert not _graphs_supported(plain, windowed, "cuda:0")  # attention_features: eager
