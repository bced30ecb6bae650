"""Runs llm-compressor's GPTQ (oneshot + GPTQModifier) on given calibration token ids; executed by
bench_quant.py with the Python of a separate virtual environment that has `llmcompressor`
installed. Argument: a JSON spec file (model, tokenizer, output, input_ids, bits, group_size,
threads, dampening, actorder; optional: symmetric (default true), observer (default
llm-compressor's own), group_size null for one range per output channel). Prints one line
`RESULT {json}`: the phase times, or the error."""

from __future__ import annotations

import json
import sys
import time
import traceback


def run(spec: dict) -> dict:
    t_import = time.perf_counter()
    import torch

    torch.set_num_threads(spec["threads"])
    import llmcompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = spec["input_ids"]
    res = {
        "llmcompressor": llmcompressor.__version__,
        "torch": torch.__version__,
        "import_s": time.perf_counter() - t_import,
    }
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32
    )  # llmctl calibrates in float32 too
    res["load_s"] = time.perf_counter() - t0
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
    group = spec["group_size"]
    extra = {"observer": spec["observer"]} if spec.get("observer") else {}
    weights = QuantizationArgs(
        num_bits=spec["bits"],
        type="int",
        symmetric=spec.get("symmetric", True),
        strategy="group" if group else "channel",
        group_size=group,
        **extra,
    )
    recipe = GPTQModifier(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=["lm_head"],
        actorder=spec["actorder"],
        dampening_frac=spec["dampening"],
        block_size=128,
    )
    t1 = time.perf_counter()
    # oneshot wants a processor whenever a dataset is given, even a tokenized one: the tokenizer
    # that made the ids
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    oneshot(
        model=model,
        dataset=data,
        recipe=recipe,
        processor=tokenizer,
        num_calibration_samples=len(ids),
        max_seq_length=len(ids[0]),
        shuffle_calibration_samples=False,
    )
    res["oneshot_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    model.save_pretrained(spec["output"], save_compressed=True)
    res["save_s"] = time.perf_counter() - t2
    res["quantize_s"] = time.perf_counter() - t0  # load + calibrate/GPTQ + save
    return res


if __name__ == "__main__":
    try:
        result = run(json.load(open(sys.argv[1])))
    except Exception as e:  # reported to the bench script, which records it and goes on
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    print("RESULT " + json.dumps(result), flush=True)
