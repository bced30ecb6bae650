"""Acceptance on the shared tinyshakespeare-5m model (needs ../shared): 4 bits, group size 64,
calibrated on the first 90% of tinyshakespeare.txt, perplexity on the last 10%:
GPTQ < RTN and AWQ < RTN, each beside the unquantized baseline.

To stay inside the test budget: 8 calibration sequences of 256 tokens, and the perplexity on the
first 8192 tokens of the held-out 10% (non-overlapping 256-token windows). All three methods use
the same (symmetric) setting so the comparison is like for like.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MODEL = SHARED / "models" / "tinyshakespeare-5m"
TEXT = SHARED / "data" / "tinyshakespeare.txt"

pytestmark = pytest.mark.skipif(
    not (MODEL / "config.json").is_file() or not TEXT.is_file(),
    reason="needs ../shared/models/tinyshakespeare-5m and ../shared/data/tinyshakespeare.txt",
)


@pytest.fixture(scope="module")
def perplexities():
    from llmctl.compress.calib_data import cut_sequences
    from llmctl.compress.driver import calibrate_layers
    from llmctl.compress.quant.layer_methods import AwqMethod, gptq_method, rtn_method
    from llmctl.runtime.evaluate import perplexity
    from llmctl.runtime.formats.spec import QuantSpec
    from llmctl.runtime.tokenizer import load_tokenizer
    from llmctl.runtime.weights import load_model

    model, _ = load_model(MODEL, "float32", "cpu")
    tok = load_tokenizer(MODEL)
    text = TEXT.read_text()
    cut = int(len(text) * 0.9)
    calib, _ = cut_sequences(tok.encode(text[:cut]), 8, 256)
    heldout = torch.tensor(tok.encode(text[cut:]))[:8192]
    ppl = lambda m: perplexity(m, heldout, seq_len=256, stride=256).perplexity  # noqa: E731
    spec = QuantSpec(bits=4, group_size=64, symmetric=True, scale_dtype=torch.float32)
    out = {"baseline": ppl(model)}
    for name, method in (
        ("rtn", rtn_method(spec)),
        ("gptq", gptq_method(spec)),
        ("awq", AwqMethod(spec)),
    ):
        m = copy.deepcopy(model)
        calibrate_layers(m, calib, method)
        out[name] = ppl(m)
    print(
        "\ntinyshakespeare-5m W4 g64 held-out perplexity:", {k: round(v, 3) for k, v in out.items()}
    )
    return out


def test_gptq_beats_rtn(perplexities):
    p = perplexities
    assert p["baseline"] < p["gptq"] < p["rtn"]


def test_awq_beats_rtn(perplexities):
    p = perplexities
    assert p["baseline"] < p["awq"] < p["rtn"]
    assert p["rtn"] < 1.05 * p["baseline"]  # 4-bit g64 costs little on this model: a sanity bound
