"""W8A8 int8 against the bf16 model on a prefill-heavy run-batch job (issue 38, run W8A).

Long prompts cut from a text file (distinct windows, so the prefix cache has nothing to share),
a few output tokens each, bf16 activations; the two models run in turn, `--rounds` times each
(A B A B ...), each run a fresh `llmctl run-batch` process; the job's own elapsed_s (its report)
is compared pairwise. The CPU kind is printed with the numbers.

    python benchmarks/bench_w8a8.py --base /tmp/smollm2-135m-instruct \
        --w8a8 /tmp/w8/smol-gptq --text ../shared/data/tinyshakespeare.txt

With --emulate-avx2 both legs run as on a CPU without AVX-512 (bench_decode_avx2.py: llmctl's
kernels built for AVX2, PyTorch's capped at AVX2), with --dtype float32 as such CPUs run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_kind() -> str:
    text = Path("/proc/cpuinfo").read_text()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "?"
    )
    flags = sorted({f for f in ("avx512_bf16", "amx_bf16", "avx512_vnni", "amx_int8") if f in text})
    return f"{model}, {os.cpu_count()} CPUs, flags {' '.join(flags)}"


def write_prompts(text_file: Path, out: Path, n: int, chars: int) -> None:
    text = text_file.read_text()
    step = max(chars, (len(text) - chars) // n)
    rows = [{"prompt": text[i * step : i * step + chars]} for i in range(n)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run(model: str, prompts: Path, work: Path, max_tokens: int, dtype: str, avx2: bool) -> dict:
    report = work / "report.json"
    cli = (
        [str(ROOT / "benchmarks" / "bench_decode_avx2.py"), "--llmctl"]
        if avx2
        else ["-m", "llmctl.cli"]
    )
    cmd = [
        sys.executable, *cli, "run-batch", str(prompts), "-o",
        str(work / "out.jsonl"), "-m", model, "--dtype", dtype, "--max-tokens",
        str(max_tokens), "--no-prefix-caching", "--overwrite", "-q", "--report-json", str(report),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), **({"AVX2_TORCH": "1"} if avx2 else {})}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return json.loads(report.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--w8a8", required=True)
    ap.add_argument("--text", required=True, type=Path)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--chars", type=int, default=2000)  # about 500 SmolLM2 tokens
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", help="both legs' activations")
    ap.add_argument("--emulate-avx2", action="store_true", help="see bench_decode_avx2.py")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    print(cpu_kind())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = work / "prompts.jsonl"
        write_prompts(a.text, prompts, a.prompts, a.chars)
        for r in range(a.rounds):
            pair = {}
            for name, model in (("base", a.base), ("w8a8", a.w8a8)):
                rep = run(model, prompts, work, a.max_tokens, a.dtype, a.emulate_avx2)
                pair[name] = rep["elapsed_s"]
                pair["prompt_tokens"] = rep["prompt_tokens"]
            pair["ratio"] = round(pair["base"] / pair["w8a8"], 3)
            print(json.dumps({"round": r, **pair}), flush=True)
            results.append(pair)
    ratios = sorted(p["ratio"] for p in results)
    print(f"base / w8a8 elapsed, per round: {ratios} (median {ratios[len(ratios) // 2]})")
    if a.json:
        out = {"cpu": cpu_kind(), "dtype": a.dtype, "emulated_avx2": a.emulate_avx2}
        a.json.write_text(json.dumps({**out, "rounds": results}, indent=1))


if __name__ == "__main__":
    main()
