"""Does `llmctl profile advise`'s recommendation, run with the command it prints, reproduce the
advised gain within the noise it states?

1. Writes the issue's prefix-case workload (tinyshakespeare fixture: --rows prompts sharing a
   405-token system prompt, each with its own 40-character question) and runs
   `profile advise MODEL --workload W --objective ttft` (--report-json).
2. Runs the printed `llmctl run-batch` line (the recommendation; `llmctl quantize` lines first
   when it quantizes) and the same line without it (the baseline: prefix caching off, no
   speculation, default budget and max-num-seqs, the base model), alternated for --rounds rounds,
   each run in its own process with --report-json, and reads the objective's p50 from each.
3. Prints the advised gain, the stated noise, and the reproduced ratio (median over the rounds,
   and each round's own), and whether the reproduced ratio is within the stated noise of the
   advised one (exit 0) or not (exit 1). The advised gain and noise are the output's
   confirmation line (the printed command in fresh processes, advise_confirm) when it has one,
   else the in-process measurement's (also printed, for comparison).

    nice -n 19 python benchmarks/check_advise_reproduce.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
CLI = [sys.executable, "-m", "llmctl.cli"]
# the run-batch flags that carry a recommendation; the baseline line drops them
TRIAL_FLAGS = ("--speculative", "--draft", "--max-num-batched-tokens", "--max-num-seqs")


def write_workload(path: Path, rows: int) -> None:
    text = (SHARED / "data" / "tinyshakespeare.txt").read_text()
    system = text[:1160]  # 405 tokens of tinyshakespeare-5m's tokenizer
    lines = [{"prompt": system + text[5000 + 300 * i : 5040 + 300 * i]} for i in range(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def llmctl(args: list[str], cwd: Path) -> None:
    subprocess.run(CLI + args, cwd=cwd, check=True, stdout=subprocess.DEVNULL)


def baseline_line(recommended: list[str], model: str) -> list[str]:
    """The recommended run-batch line with the recommendation taken out."""
    out, skip = [], False
    for i, a in enumerate(recommended):
        if skip:
            skip = False
            continue
        if a in TRIAL_FLAGS:
            skip = True
            continue
        out.append(model if i > 0 and recommended[i - 1] == "--model" else a)
    return out if "--no-prefix-caching" in out else out + ["--no-prefix-caching"]


def run_batch(line: list[str], cwd: Path, tag: str, key: str) -> float:
    """One run of a printed run-batch line (`llmctl` dropped); the objective's value."""
    out, report = cwd / f"{tag}.out.jsonl", cwd / f"{tag}.report.json"
    llmctl(line[1:] + ["-o", str(out), "--report-json", str(report), "-q"], cwd)
    summary = json.loads(report.read_text())
    summary = summary.get("summary", summary)
    if key == "output_tokens_per_s":
        return summary[key]
    return summary[key]["p50"]


def advised_gain(record: dict) -> float:
    objective, base = record["settings"]["objective"], record["baseline"]
    best = record["combined"] or next(
        t for t in record["trials"] if t["key"] in record["recommended"]
    )
    m = best["measurement"]
    if objective == "throughput":
        return m["output_tokens_per_s"] / base["output_tokens_per_s"]
    key = f"{objective}_s"
    return base[key]["p50"] / m[key]["p50"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHARED / "models" / "tinyshakespeare-5m"))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="advise-reproduce-") as tmp:
        cwd = Path(tmp)
        workload, record_path = cwd / "prefix.jsonl", cwd / "advise.json"
        write_workload(workload, args.rows)
        llmctl(["profile", "advise", args.model, "--workload", str(workload), "--objective",
                "ttft", "--max-tokens", str(args.max_tokens), "--device", "cpu",
                "--report-json", str(record_path), "-q"], cwd)  # fmt: skip
        record = json.loads(record_path.read_text())
        if not record["recommended"]:
            print(f"advise recommended nothing (noise +/-{record['noise']:.1%}): nothing to check")
            return 1
        *prep, line = record["commands"]
        for cmd in prep:  # llmctl quantize ...
            llmctl(shlex.split(cmd)[1:], cwd)
        rec = shlex.split(line)
        base = baseline_line(rec, args.model)
        objective = record["settings"]["objective"]
        key = "output_tokens_per_s" if objective == "throughput" else f"{objective}_s"
        ratios = []
        for r in range(args.rounds):  # alternated: load drifts affect both sides alike
            b = run_batch(base, cwd, f"base{r}", key)
            a = run_batch(rec, cwd, f"rec{r}", key)
            ratios.append(a / b if objective == "throughput" else b / a)
    gain, noise, got = advised_gain(record), record["noise"], statistics.median(ratios)
    confirmed = record.get("confirmed")
    if confirmed and confirmed["gain"]:
        print(f"in-process gain ({objective} p50): {gain:.2f}x, noise +/-{noise:.1%}")
        gain, noise = confirmed["gain"], confirmed["noise"]
        print("confirmed by advise with the printed command: rounds "
              + ", ".join(f"{x:.2f}x" for x in confirmed["rounds"] if x))  # fmt: skip
    print(f"recommended: {', '.join(record['recommended'])}")
    print(f"  {line}")
    print(f"advised gain ({objective} p50): {gain:.2f}x, stated noise +/-{noise:.1%}")
    print(f"reproduced with the printed command: {got:.2f}x (median of {args.rounds} rounds: "
          + ", ".join(f"{x:.2f}x" for x in ratios) + ")")  # fmt: skip
    ok = abs(got / gain - 1) <= noise
    print(
        "within the stated noise" if ok else f"NOT within the stated noise ({got / gain:.2f} of it)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
