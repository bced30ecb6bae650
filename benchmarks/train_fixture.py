"""Train the second quantization-quality fixture (issue 17): a small Llama of another shape than
tinyshakespeare-5m, on the first 90% of the characters of tinyshakespeare.txt, saved as a Hugging
Face folder (cached: an existing folder is kept unless --force).

Shape (default): 4 layers, hidden 256, 4 heads of 64 with as many KV heads (no GQA, so AWQ's
v_proj -> o_proj fold runs), FFN 512, untied embeddings, the tinyshakespeare-5m tokenizer
(vocab 2048). Every input width (256, 512) divides by 128, so group size 128 is measured too
(tinyshakespeare-5m's FFN width 704 does not allow it). AdamW, linear warm-up then cosine decay,
batches of random 256-token windows; one thread by default (the machine is shared).

    python benchmarks/train_fixture.py --out /tmp/llmctl-bench/ts-llama-4l256
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHARED  # noqa: E402

TOKENIZER_FROM = SHARED / "models" / "tinyshakespeare-5m"
TEXT = SHARED / "data" / "tinyshakespeare.txt"
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def model_config(args, vocab: int):
    import transformers

    src = json.loads((TOKENIZER_FROM / "config.json").read_text())
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // args.head_dim,
        num_key_value_heads=args.hidden // args.head_dim,
        head_dim=args.head_dim,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=src["bos_token_id"],
        eos_token_id=src["eos_token_id"],
        pad_token_id=src["pad_token_id"],
    )


def train(args) -> dict:
    import transformers

    from llmctl.runtime.tokenizer import load_tokenizer

    text = TEXT.read_text()
    ids = torch.tensor(load_tokenizer(TOKENIZER_FROM).encode(text[: int(len(text) * 0.9)]))
    config = model_config(
        args, json.loads((TOKENIZER_FROM / "config.json").read_text())["vocab_size"]
    )
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warm = max(1, args.steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine to a tenth
        if step < warm:
            return args.lr * (step + 1) / warm
        t = (step - warm) / max(1, args.steps - warm)
        return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))

    g = torch.Generator().manual_seed(args.seed)
    t0, loss = time.perf_counter(), float("nan")
    for step in range(args.steps):
        starts = torch.randint(0, ids.numel() - args.seq_len - 1, (args.batch,), generator=g)
        batch = torch.stack([ids[s : s + args.seq_len + 1] for s in starts])  # [B, S + 1]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        out = model(input_ids=batch[:, :-1], labels=batch[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(out.loss)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss:.3f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    model.save_pretrained(args.out, safe_serialization=True)
    return {
        "steps": args.steps,
        "final_train_loss": loss,
        "seconds": time.perf_counter() - t0,
        "params": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/llmctl-bench/ts-llama-4l256"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--force", action="store_true")
    args = p.parse_args()
    if (args.out / "model.safetensors").exists() and not args.force:
        print(f"{args.out} exists (use --force to retrain)")
        return
    torch.set_num_threads(args.threads)
    report = train(args)
    for name in SIDE_FILES:
        if (TOKENIZER_FROM / name).exists():
            shutil.copy(TOKENIZER_FROM / name, args.out / name)
    report.update({k: str(v) for k, v in vars(args).items()})
    report["corpus"] = "tinyshakespeare.txt, first 90% of characters"
    (args.out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
