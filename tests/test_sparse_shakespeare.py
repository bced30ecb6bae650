"""Acceptance on the trained fixture ../shared/models/tinyshakespeare-5m at 2:4.

Held-out text: the last 10% of ../shared/data/tinyshakespeare.txt (the model trained on the first
90%); to stay within the test budget, perplexity is taken on every 4th non-overlapping 256-token
window of it (42 windows, ~10.7k tokens). Calibration: 8 sequences of 128 tokens from the first 90%.
"""

from __future__ import annotations

import pytest
import torch

from llmctl.compress.calib_data import cut_sequences
from llmctl.compress.driver import calibrate_layers
from llmctl.compress.quant.layer_methods import gptq_method
from llmctl.compress.sparse.masks import parse_pattern
from llmctl.compress.sparse.model import SparsifySettings, sparsify_model
from llmctl.runtime.evaluate import perplexity
from llmctl.runtime.formats.spec import QuantSpec
from llmctl.runtime.loader import load_runtime
from llmctl.runtime.semi_structured import satisfies_nm
from tests.conftest import shared_path

WINDOW = 256


@pytest.fixture(scope="module")
def setup():
    text_path = shared_path("data/tinyshakespeare.txt")
    model_path = shared_path("models/tinyshakespeare-5m")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster on a shared 2-core machine
    rt = load_runtime(str(model_path), dtype="float32", device="cpu")
    text = text_path.read_text()
    cut = int(len(text) * 0.9)
    calib, _ = cut_sequences(rt.encode(text[:cut]), 8, 128)
    held = torch.tensor(rt.encode(text[cut:]))
    n = held.numel() // WINDOW
    held = held[: n * WINDOW].reshape(n, WINDOW)[::4].flatten()
    state = {k: v.clone() for k, v in rt.model.state_dict().items()}
    yield rt.model, state, calib, held
    torch.set_num_threads(threads)


def _ppl(model, held) -> float:
    return perplexity(model, held, seq_len=WINDOW, stride=WINDOW).perplexity


def _prune(model, state, method, calib):
    model.load_state_dict(state)
    result = sparsify_model(model, SparsifySettings(parse_pattern("2:4", None), method), calib)
    assert len(result.lines) == 42 and not result.targets.skipped
    for name in result.targets.names:  # every 4-wide group of every pruned layer has >= 2 zeros
        assert satisfies_nm(model.get_submodule(name).weight, 2, 4), name
    return result


def test_wanda_and_sparsegpt_beat_magnitude_at_2of4(setup):
    model, state, calib, held = setup
    dense = _ppl(model, held)
    ppl = {}
    for method in ("magnitude", "wanda", "sparsegpt"):
        _prune(model, state, method, calib)
        ppl[method] = _ppl(model, held)
    assert dense < ppl["sparsegpt"] and dense < ppl["wanda"]
    assert ppl["wanda"] < ppl["magnitude"], ppl
    assert ppl["sparsegpt"] < ppl["magnitude"], ppl
    model.load_state_dict(state)


def test_2of4_then_gptq_4bit_keeps_zeros(setup):
    """SparseGPT 2:4, then GPTQ 4-bit (group 64, act-order) calibrated on the sparse model's
    inputs."""
    model, state, calib, held = setup
    result = _prune(model, state, "sparsegpt", calib)
    sparse_ppl = _ppl(model, held)
    # quantize's own GPTQ layer method: it masks exact zeros (preserve_zeros, on by default)
    calibrate_layers(model, calib, gptq_method(QuantSpec(bits=4, group_size=64)))
    for name in result.targets.names:
        assert satisfies_nm(model.get_submodule(name).weight, 2, 4), name
    quant_ppl = _ppl(model, held)
    assert sparse_ppl < quant_ppl < sparse_ppl * 1.15, (sparse_ppl, quant_ppl)
    model.load_state_dict(state)
