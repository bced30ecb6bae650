"""Experiment (issue 17): llmctl's GPTQ with llm-compressor's two pipeline choices, to tell an
implementation difference from a choice. `layer`: every linear of a decoder layer observed on the
unquantized layer before any is quantized (llm-compressor's sequential pipeline; llmctl's default
observes each sub-layer group on the outputs of the groups already quantized); `shrink`: the MSE
range grid stops at 0.81, as llm-compressor's (llmctl's goes to 0.80). Other arguments go to
bench_quant_quality.py.

    python benchmarks/exp_gptq_llmc_choices.py layer+shrink --bits 4 3 --groups 64 channel \
        --configs gptq --draws 3 --threads 1
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llmctl.compress import driver  # noqa: E402
from llmctl.compress.quant import observer  # noqa: E402
from llmctl.models.layout import SUBLAYER_GROUPS  # noqa: E402


def _per_layer(i, layer, method, ignore, run) -> dict[str, Any]:
    records: dict[str, Any] = {}
    todo = []
    for group in SUBLAYER_GROUPS:
        names = [n for n in (f"model.layers.{i}.{rel}" for rel in group.linears) if not ignore(n)]
        if names:
            driver._observe_group(method, layer, group, names, lambda: run(keep=False))
            todo.append((group, names))
    for group, names in todo:
        records.update(method.process_group(i, layer, group, names))
    records.update(method.finish_layer(i, layer))
    return records


if __name__ == "__main__":
    mode = sys.argv.pop(1)
    if "shrink" in mode:
        observer.mse_params.__kwdefaults__["min_shrink"] = 0.81
    if "layer" in mode:
        driver._calibrate_layer = _per_layer
    sys.argv[1:1] = ["--models", "/work/shared/models/tinyshakespeare-5m"]
    import bench_quant_quality

    bench_quant_quality.main()
