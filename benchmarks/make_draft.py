"""Make a draft model for speculative decoding: a truncated, distilled copy of a target.

The student starts as the target's embeddings, first LAYERS decoder layers, final norm and lm_head,
then trains briefly on the first 90% of tinyshakespeare.txt to match the target's next-token
distribution (KL(target || student), temperature 1, AdamW). Top-1 agreement with the target on the
last 10% of the text is printed before and after. The result is a Hugging Face folder (config.json,
model.safetensors, generation_config.json, the target's tokenizer files) that llmctl loads.

    nice -n 19 python benchmarks/make_draft.py --layers 2 --threads 1

writes /tmp/llmctl-bench/ts-draft-2L (LLMCTL_BENCH_CACHE changes /tmp/llmctl-bench); `--force`
remakes it. bench_speculative.py calls `ensure_draft`, which makes it only when missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"
TARGET = SHARED / "models" / "tinyshakespeare-5m"
TEXT = SHARED / "data" / "tinyshakespeare.txt"
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def draft_dir(layers: int) -> Path:
    return Path(os.environ.get("LLMCTL_BENCH_CACHE", "/tmp/llmctl-bench")) / f"ts-draft-{layers}L"


def token_splits(tokenizer, text_path: Path = TEXT) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the first 90% of the characters (training) and the last 10% (held out)."""
    text = text_path.read_text()
    cut = int(0.9 * len(text))
    return (torch.tensor(tokenizer.encode(text[:cut])), torch.tensor(tokenizer.encode(text[cut:])))


def truncated_student(target, layers: int):
    """A LlamaForCausalLM with the target's first `layers` decoder layers (and embeddings, norm,
    head)."""
    from transformers import LlamaForCausalLM

    cfg = target.config.__class__.from_dict(target.config.to_dict())
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    student = LlamaForCausalLM(cfg)
    keep = {
        k: v
        for k, v in target.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    student.load_state_dict(keep, strict=True)
    return student


def kl_loss(student_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(target || student) per token, temperature 1."""
    s = F.log_softmax(student_logits.float().flatten(0, 1), dim=-1)
    t = F.log_softmax(target_logits.float().flatten(0, 1), dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


@torch.no_grad()
def agreement(student, target, held: torch.Tensor, seq_len: int, windows: int) -> dict:
    """Top-1 match rate of student and target over `windows` non-overlapping held-out windows."""
    n = min(windows, len(held) // seq_len)
    ids = held[: n * seq_len].view(n, seq_len)
    match, kl = 0, 0.0
    for row in ids.split(8):
        s, t = student(row).logits, target(row).logits
        match += int((s.argmax(-1) == t.argmax(-1)).sum())
        kl += float(kl_loss(s, t)) * row.numel()
    return {"top1_agreement": match / ids.numel(), "kl": kl / ids.numel(), "tokens": ids.numel()}


def train(
    student,
    target,
    data: torch.Tensor,
    steps: int,
    batch: int,
    seq_len: int,
    lr: float,
    seed: int = 0,
) -> list[float]:
    """AdamW on KL to the target; warm-up then cosine to lr/10. Returns the loss every 10 steps."""
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: (
            (i + 1) / warm
            if i < warm
            else 0.1 + 0.45 * (1 + math.cos(math.pi * (i - warm) / max(1, steps - warm)))
        ),
    )
    g = torch.Generator().manual_seed(seed)
    student.train()
    losses = []
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq_len, (batch,), generator=g)
        ids = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        with torch.no_grad():
            t = target(ids).logits
        loss = kl_loss(student(ids).logits, t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0 or step == steps - 1:
            losses.append(round(loss.item(), 4))
            print(f"  step {step:4d}  kl {losses[-1]:.4f}", flush=True)
    student.eval()
    return losses


def save(student, target_dir: Path, out: Path, report: dict) -> None:
    """Write the folder under a temporary name, then rename, so a half-written draft is never
    cached."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    student.save_pretrained(tmp, safe_serialization=True)
    for name in COPIED:
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, tmp / name)
    (tmp / "draft_report.json").write_text(json.dumps(report, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def check_loads(out: Path, student, probe: torch.Tensor) -> None:
    """llmctl's loader reads the folder and its model agrees with the transformers student."""
    from llmctl.runtime.loader import load_runtime

    rt = load_runtime(str(out), dtype="float32", device="cpu")
    with torch.no_grad():
        ours = rt.model.forward_dense(probe[None])[0]
        ref = student(probe[None]).logits[0]
    assert rt.config.num_layers == student.config.num_hidden_layers and rt.tokenizer is not None
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), (
        "llmctl and transformers disagree on the draft"
    )


def make_draft(
    layers: int = 2,
    target_dir: Path = TARGET,
    out: Path | None = None,
    steps: int = 200,
    batch: int = 8,
    seq_len: int = 256,
    lr: float = 1e-3,
    eval_windows: int = 64,
) -> Path:
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = out or draft_dir(layers)
    t0 = time.perf_counter()
    target = (
        LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
        .eval()
        .requires_grad_(False)
    )
    train_ids, held = token_splits(AutoTokenizer.from_pretrained(str(target_dir)))
    student = truncated_student(target, layers).eval()
    before = agreement(student, target, held, seq_len, eval_windows)
    print(
        f"draft {layers}L before training: held-out top-1 agreement "
        f"{before['top1_agreement']:.3f}, KL {before['kl']:.3f}",
        flush=True,
    )
    t1, c1 = time.perf_counter(), time.process_time()
    losses = train(student, target, train_ids, steps, batch, seq_len, lr)
    train_s, train_cpu = time.perf_counter() - t1, time.process_time() - c1
    after = agreement(student, target, held, seq_len, eval_windows)
    print(
        f"draft {layers}L after {steps} steps ({train_s:.0f} s wall, {train_cpu:.0f} s CPU): "
        "held-out top-1 agreement "
        f"{after['top1_agreement']:.3f}, KL {after['kl']:.3f}",
        flush=True,
    )
    report = {
        "target": str(target_dir),
        "layers": layers,
        "steps": steps,
        "batch": batch,
        "seq_len": seq_len,
        "lr": lr,
        "threads": torch.get_num_threads(),
        "train_seconds": train_s,
        "train_cpu_seconds": train_cpu,
        "total_seconds": time.perf_counter() - t0,
        "before": before,
        "after": after,
        "losses_every_10_steps": losses,
    }
    save(student, target_dir, out, report)
    check_loads(out, student, held[:64])
    print(f"saved {out} (loads in llmctl)", flush=True)
    return out


def ensure_draft(layers: int = 2, **kw) -> Path:
    """The cached draft folder, made first when missing."""
    out = draft_dir(layers)
    return out if (out / "model.safetensors").is_file() else make_draft(layers, out=out, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--target", default=str(TARGET))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--eval-windows",
        type=int,
        default=64,
        help="held-out windows of SEQ_LEN tokens for the agreement",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="default: /tmp/llmctl-bench/ts-draft-{layers}L")
    ap.add_argument("--force", action="store_true", help="remake even when the folder exists")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else draft_dir(args.layers)
    if (out / "model.safetensors").is_file() and not args.force:
        print(
            f"{out} exists (--force remakes it): "
            f"{json.loads((out / 'draft_report.json').read_text())['after']}"
        )
        return
    make_draft(
        args.layers,
        Path(args.target),
        out,
        args.steps,
        args.batch,
        args.seq_len,
        args.lr,
        args.eval_windows,
    )


if __name__ == "__main__":
    main()
