"""Training throughput of `llmctl distill` beside TRL's GKDTrainer, in the same run (issue 15).

Same teacher (../shared/models/tinyshakespeare-5m), same 2-layer student (teacher layers 0 and 5,
embeddings, norm and lm_head copied), same text (the first 90% of tinyshakespeare.txt), steps,
batch, sequence length, lr, warm-up and cosine schedule, float32 on the CPU, off-policy
(TRL: lmbda 0, seq_kd off) and forward KL(teacher || student) at temperature 1 (TRL: beta 0;
llmctl: the default --loss fkl, --alpha-ce 0). TRL reads conversations: each example is one
user turn (the first third of a text chunk) and one assistant turn (the rest), through the demo
model's plain chat template; its loss covers the assistant tokens only, so its tokens/s counts
every token it forwards (padding excluded). TRL needs a venv (it is no dependency of llmctl):

    python -m venv --system-site-packages /tmp/trl-venv && /tmp/trl-venv/bin/pip install trl
    PYTHONPATH=. /tmp/trl-venv/bin/python benchmarks/bench_distill_trl.py --steps 20 \\
        --json benchmarks/results/distill_trl.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from common import environment
from make_draft import TARGET, TEXT

from llmctl.cli import main

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)


def hf_student(teacher, keep: list[int]):
    from transformers import LlamaForCausalLM

    cfg = teacher.config.__class__.from_dict(teacher.config.to_dict())
    cfg.num_hidden_layers = len(keep)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in keep]
    student = LlamaForCausalLM(cfg)
    sd = {}
    for k, v in teacher.state_dict().items():
        if k.startswith("model.layers."):
            i = int(k.split(".")[2])
            if i not in keep:
                continue
            k = k.replace(f"model.layers.{i}.", f"model.layers.{keep.index(i)}.", 1)
        sd[k] = v.clone()
    student.load_state_dict(sd, strict=True)
    return student


def run_trl(args, train_text: str, out: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    tok = AutoTokenizer.from_pretrained(str(TARGET))
    tok.chat_template = TEMPLATE
    teacher = LlamaForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    student = hf_student(teacher, [0, 5])
    chunk = args.chars or int(2.4 * args.seq_len)  # about 2.8 characters a token: fits seq-len
    rows = []
    for s in range(0, min(len(train_text), chunk * args.steps * args.batch_size * 2), chunk):
        piece = train_text[s : s + chunk]
        cut = len(piece) // 3
        rows.append(
            {"messages": [{"role": "user", "content": piece[:cut]},
                          {"role": "assistant", "content": piece[cut:]}]}
        )  # fmt: skip
    cfg = GKDConfig(
        output_dir=str(out), per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=10, lmbda=0.0, beta=0.0,
        temperature=1.0, seq_kd=False, max_length=args.seq_len, logging_steps=10,
        report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0, seed=0,
        max_grad_norm=1.0, weight_decay=0.0,
    )  # fmt: skip
    trainer = GKDTrainer(
        model=student, teacher_model=teacher, args=cfg, processing_class=tok,
        train_dataset=Dataset.from_list(rows),
    )  # fmt: skip
    counted = {"tokens": 0}
    step = trainer.training_step

    def counting_step(model, inputs, *a, **kw):
        counted["tokens"] += int(inputs["attention_mask"].sum())
        return step(model, inputs, *a, **kw)

    trainer.training_step = counting_step
    t0 = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - t0
    return {
        "tokens": counted["tokens"],
        "train_seconds": wall,
        "tokens_per_s": counted["tokens"] / wall,
        "train_loss": result.training_loss,
    }


def run_llmctl(args, train: Path, out: Path) -> dict:
    report = out.parent / "llmctl.json"
    argv = [
        "distill", "--teacher", str(TARGET), "-o", str(out), "--data", str(train),
        "--student-layers", "2", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
        "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--dtype", "float32",
        "--device", "cpu", "-q", "--report-json", str(report),
    ]  # fmt: skip
    assert main(argv) == 0
    r = json.loads(report.read_text())
    tokens = args.steps * args.batch_size * args.seq_len
    return {"command": "llmctl " + " ".join(argv), "tokens": tokens,
            "tokens_per_s": r["tokens_per_s"], "final_loss": r["final_loss"]}  # fmt: skip


def run() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--chars", type=int, help="characters per TRL example (default 2.4 x seq-len)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--trl-first", action="store_true", help="run TRL before llmctl")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    text = TEXT.read_text()
    train_text = text[: int(0.9 * len(text))]
    with tempfile.TemporaryDirectory(prefix="bench-distill-trl-") as tmp:
        folder = Path(tmp)
        (folder / "train.txt").write_text(train_text)
        order = ("trl", "llmctl") if args.trl_first else ("llmctl", "trl")
        for name in order:  # the host's load drifts: --trl-first runs them the other way round
            if name == "llmctl":
                ours = run_llmctl(args, folder / "train.txt", folder / "llmctl")
                print(f"  llmctl distill: {ours['tokens_per_s']:.0f} tokens/s", flush=True)
            else:
                trl = run_trl(args, train_text, folder / "trl")
                print(f"  TRL GKDTrainer: {trl['tokens_per_s']:.0f} tokens/s", flush=True)
    doc = {
        "benchmark": "bench_distill_trl",
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "llmctl": ours,
        "trl_gkd": trl,
        "environment": environment(),
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    run()
