"""Experiment (issue 17): llmctl's GPTQ with llm-compressor's remaining pipeline choice, to tell
an implementation difference from a choice. `shrink`: the MSE range grid stops at 0.81, as
llm-compressor's (llmctl's goes to 0.80). The other choice, every linear of a decoder layer
observed on the unquantized layer, is now GPTQ's default (`gptq:whole_layer=0` turns it off).
Other arguments go to bench_quant_quality.py.

    python benchmarks/exp_gptq_llmc_choices.py shrink --bits 4 3 --groups 64 channel \
        --configs gptq --draws 3 --threads 1
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llmctl.compress.quant import observer  # noqa: E402

if __name__ == "__main__":
    if sys.argv.pop(1) != "shrink":
        sys.exit("usage: exp_gptq_llmc_choices.py shrink [bench_quant_quality.py arguments]")
    observer.mse_params.__kwdefaults__["min_shrink"] = 0.81
    sys.argv[1:1] = ["--models", "/work/shared/models/tinyshakespeare-5m"]
    import bench_quant_quality

    bench_quant_quality.main()
