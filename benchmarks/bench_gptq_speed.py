"""GPTQ's shared-input path against the per-linear path (issue 17, speed), in one process.

Layers of the SmolLM2-135M shape (shared/configs/smollm2-135m.json, --layers of them, random
weights, float32 on the CPU) calibrated with `gptq_method`'s defaults at 4 bits, group 64, on
--samples x --seq-len random token ids: A = the command's path (q/k/v and gate/up share one
Hessian accumulator and are quantized as one stacked weight), B = the old path (one accumulator
and one GPTQ call per linear), run in turn A B A B ... so a drifting machine moves both; medians.

    python benchmarks/bench_gptq_speed.py --layers 2 --samples 16 --seq-len 512 -n 3
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHARED, environment  # noqa: E402


class PerLinear:
    """The old path: every linear its own accumulator (never shares) and its own GPTQ call."""

    def __init__(self, fn):
        from llmctl.compress.driver import HessianMethod

        self.inner = HessianMethod(fn)

    def observe(self, name, x):
        self.inner._last = None  # forget the previous input: no sharing
        self.inner.observe(name, x)

    def process_group(self, *a):
        return self.inner.process_group(*a)

    def finish_layer(self, *a):
        return {}


def main() -> None:
    from llmctl.compress.driver import calibrate_layers
    from llmctl.compress.quant.layer_methods import gptq_method
    from llmctl.models.config import ModelConfig
    from llmctl.models.llama import LlamaForCausalLM
    from llmctl.runtime.formats.spec import QuantSpec

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("-n", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    raw = json.loads((SHARED / "configs" / "smollm2-135m.json").read_text())
    cfg = ModelConfig.from_dict({**raw, "num_hidden_layers": args.layers})
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    for p_ in model.parameters():
        p_.data.normal_(0, 0.02)
    ids = torch.randint(0, cfg.vocab_size, (args.samples, args.seq_len))
    spec = QuantSpec(4, 64, True, torch.float16)
    times: dict[str, list[float]] = {"shared": [], "per_linear": []}
    for _ in range(args.n):
        for side in times:
            method = gptq_method(spec)
            if side == "per_linear":
                method = PerLinear(method.fn)
            m = copy.deepcopy(model)
            t0 = time.perf_counter()
            calibrate_layers(m, ids, method)
            times[side].append(time.perf_counter() - t0)
            print(f"{side}: {times[side][-1]:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    speedup = med["per_linear"] / med["shared"]
    print(f"medians {med}; shared path {speedup:.2f}x faster", flush=True)
    if args.json:
        out = {"environment": environment(), "args": vars(args) | {"json": str(args.json)}}
        args.json.write_text(json.dumps(out | {"seconds": times, "speedup": speedup}, indent=1))


if __name__ == "__main__":
    main()
