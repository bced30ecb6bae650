"""Decode with CUDA graphs against the same engine run eagerly (`--enforce-eager`), on CUDA.

Batch sizes 1, 8 and 64 by default: each runs that many requests of a 128-token prompt and
`--output-len` new tokens together; reports decode tokens/s after the first token (output tokens
past the first over the time from the last first token to the end) for both modes and the ratio.

    python benchmarks/bench_cuda_graphs.py --config smollm2-135m --json out.json
    python benchmarks/bench_cuda_graphs.py --config path/to/config.json --batches 1,16

Off CUDA it prints {"skipped": ...} and exits 0: graphs only exist there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_throughput import model_folder  # noqa: E402
from benchmarks.common import workload  # noqa: E402


def decode_rate(folder: Path, dtype: str, batch: int, out_len: int, graphs: bool) -> dict:
    from llmctl import LLM, SamplingParams

    llm = LLM(
        str(folder), dtype=dtype, device="cuda", cuda_graphs=graphs, max_num_seqs=max(batch, 1)
    )
    vocab = llm.runtime.config.vocab_size
    prompts = workload(batch, (128, 128), vocab=vocab, seed=11)[0]
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    llm.generate(
        prompts, SamplingParams(max_tokens=8, ignore_eos=True)
    )  # warm-up: compiles, captures
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    end = time.perf_counter() - t0
    decode_s = max(o.finish_time for o in outs) - max(o.first_token_time for o in outs)
    tokens = sum(len(o.output_token_ids) - 1 for o in outs)
    runner = llm.engine.runner
    return {
        "decode_tok_s": tokens / max(decode_s, 1e-9),
        "seconds": end,
        "graph_steps": runner.graphs.replays if runner.graphs is not None else 0,
        "tokens": [o.output_token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config", default="smollm2-135m", help="a shared/configs name, or a path to a config.json"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: CUDA graphs only exist there"}))
        return
    folder = model_folder(args.config)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        eager = decode_rate(folder, args.dtype, b, args.output_len, graphs=False)
        graph = decode_rate(folder, args.dtype, b, args.output_len, graphs=True)
        row = {
            "batch": b,
            "eager_decode_tok_s": eager["decode_tok_s"],
            "graph_decode_tok_s": graph["decode_tok_s"],
            "speedup": graph["decode_tok_s"] / eager["decode_tok_s"],
            "graph_steps": graph["graph_steps"],
            "same_tokens": graph["tokens"] == eager["tokens"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    record = {
        "config": args.config,
        "dtype": args.dtype,
        "output_len": args.output_len,
        "device": torch.cuda.get_device_name(),
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
