"""Dense vs 2:4 semi-structured sparse on an NVIDIA GPU: per weight shape, and end to end.

Prints JSON lines (one per case); run by benchmarks/gpu_check.sh. Needs CUDA (Ampere or newer);
elsewhere it prints one `skipped` line.
"""

from __future__ import annotations

import argparse
import json

import torch

from llmctl.runtime.semi_structured import (
    _cuda_ms,
    accelerate_2of4,
    semi_structured_support,
    time_dense_vs_sparse,
)


def _bench_model(
    config_path: str, batch: int, seq_len: int, dtype: torch.dtype, iters: int
) -> dict:
    """End to end: forward_dense of a randomly initialised model of `config_path`'s shape,
    2:4-pruned by magnitude, dense against semi-structured (only the linears measured faster are
    converted)."""
    from llmctl.compress.sparse.masks import parse_pattern
    from llmctl.compress.sparse.model import SparsifySettings, sparsify_model
    from llmctl.models.config import ModelConfig
    from llmctl.models.llama import LlamaForCausalLM

    config = ModelConfig.from_file(config_path)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    targets = sparsify_model(
        model, SparsifySettings(parse_pattern("2:4", None), "magnitude")
    ).targets
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), device="cuda")
    with torch.no_grad():
        dense_ms = _cuda_ms(lambda: model.forward_dense(ids), iters)
        decisions = accelerate_2of4(model, targets.names, tokens=batch * seq_len)
        sparse_ms = _cuda_ms(lambda: model.forward_dense(ids), iters)
    return {
        "model": config_path,
        "batch": batch,
        "seq_len": seq_len,
        "dense_ms": round(dense_ms, 3),
        "semi_structured_ms": round(sparse_ms, 3),
        "end_to_end_speedup": round(dense_ms / sparse_ms, 3),
        "linears_converted": sum(d.converted for d in decisions),
        "linears": len(decisions),
    }


def main(argv: list[str] | None = None) -> int:
    """Time dense vs 2:4 sparse linears of real model shapes; prints JSON lines (one per case)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model-config",
        action="append",
        default=[],
        help="also time a whole forward pass of a random model with this config.json (repeatable)",
    )
    p.add_argument("--batch-seq", default="1x128,8x512", help="BATCHxSEQ cases for --model-config")
    p.add_argument(
        "--shapes",
        default="2048x2048,5632x2048,2048x5632,4096x4096,14336x4096,4096x14336",
        help="out x in weight shapes",
    )
    p.add_argument("--tokens", default="1,16,128,1024,4096", help="rows of the activation matrix")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    ok, why = semi_structured_support("cuda")
    if not ok:
        print(json.dumps({"skipped": why}))
        return 0
    dtype = getattr(torch, args.dtype)
    for spec in args.shapes.split(","):
        out_f, in_f = (int(v) for v in spec.split("x"))
        w = torch.randn(out_f, in_f, dtype=dtype, device="cuda")
        w = w.reshape(out_f, in_f // 4, 4)
        w[..., torch.tensor([1, 3])] = 0  # a valid 2:4 pattern; values do not matter for timing
        w = w.reshape(out_f, in_f)
        for tokens in (int(t) for t in args.tokens.split(",")):
            try:
                dense_ms, sparse_ms = time_dense_vs_sparse(w, tokens, args.iters)
                row = {
                    "shape": spec,
                    "tokens": tokens,
                    "dense_ms": round(dense_ms, 4),
                    "sparse_ms": round(sparse_ms, 4),
                    "speedup": round(dense_ms / sparse_ms, 3),
                }
            except RuntimeError as e:  # a kernel that refuses this shape is a result too
                row = {"shape": spec, "tokens": tokens, "error": str(e).splitlines()[0][:200]}
            print(json.dumps(row), flush=True)
    for path in args.model_config:
        for case in args.batch_seq.split(","):
            batch, seq_len = (int(v) for v in case.split("x"))
            try:
                row = _bench_model(path, batch, seq_len, dtype, max(5, args.iters // 5))
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                row = {
                    "model": path,
                    "batch": batch,
                    "seq_len": seq_len,
                    "error": str(e).splitlines()[0][:200],
                }
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
