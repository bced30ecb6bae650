"""llm-compressor's own W8A8 (SmoothQuant, then W8A8 by QuantizationModifier or GPTQModifier) of a
model, written as compressed-tensors, for checking that llmctl loads and serves what
llm-compressor writes (issue 38). Run with the Python of a venv that has `llmcompressor`:

    /work/venvs/llmc/bin/python benchmarks/llmc_w8a8.py /tmp/smollm2-135m-instruct out-folder \
        --calib ../shared/data/tinyshakespeare.txt --num-samples 32 --seq-len 256 [--gptq]

Calibration: the first 90% of the text file (by characters, as run W8A's ts_train.txt), cut into
--num-samples windows of --seq-len tokens. Prints one `RESULT {json}` line.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--calib", required=True)
    p.add_argument("--num-samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--gptq", action="store_true")
    p.add_argument("--smoothing-strength", type=float, default=0.8)
    a = p.parse_args()
    import llmcompressor
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model)
    text = open(a.calib).read()
    ids = tok(text[: int(len(text) * 0.9)])["input_ids"]
    rows = [ids[i * a.seq_len : (i + 1) * a.seq_len] for i in range(a.num_samples)]
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16)
    quant = GPTQModifier if a.gptq else QuantizationModifier
    recipe = [
        SmoothQuantModifier(smoothing_strength=a.smoothing_strength),
        quant(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
    ]
    t0 = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=a.seq_len,
            num_calibration_samples=a.num_samples)  # fmt: skip
    model.save_pretrained(a.out, save_compressed=True)
    tok.save_pretrained(a.out)
    result = {"llmcompressor": llmcompressor.__version__, "gptq": a.gptq,
              "seconds": round(time.perf_counter() - t0, 1), "out": a.out}  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
