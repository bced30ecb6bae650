"""`llmctl quantize` benchmarks (issue "llmctl quantize"), CPU only.

1. Batch-1 decode of an int4 checkpoint against bf16 through llmctl's engine, on a randomly
   initialised model of a shared/configs shape (default smollm2-135m). The int4 folder is our own
   RTN (`llmctl quantize --rtn --bits 4`), cached under /tmp/llmctl-bench. SmolLM2's hidden width
   576 is not a multiple of 128, which llmctl quantize refuses (naming the sizes that work), so the
   largest working group size <= --group-size is used and the output says so. Reported: TTFT
   (prefill of --prompt-len tokens), decode tokens/s after the first token, the speedup, which
   linears run the int4 kernel, and MBU = weight bytes read per decode step x steps/s over the
   memory read bandwidth measured at the start of the run (weights only: KV cache not counted).
2. GPTQ wall time, ours (`llmctl quantize --gptq`: its defaults, no act-order, MSE ranges,
   dampening 0.01) against llm-compressor's (oneshot + GPTQModifier with the same bits, group,
   symmetry, no act-order, its `mse` observer, dampening,
   run by llmc_worker.py in its own venv, LLMC_PYTHON), on the same calibration token sequences:
   tinyshakespeare.txt tokenized once with the tinyshakespeare-5m tokenizer (the random model has
   none), the first 90% given to both as prompt_token_ids, the last 10% held out for perplexity of
   both outputs (llmctl.runtime.evaluate.perplexity). llmctl gets a 4-token --eval-data stub so its
   own before/after perplexity, which llm-compressor does not compute, costs nothing. Both run as
   subprocesses with OMP_NUM_THREADS=--threads, models loaded in float32. Times: "whole command"
   (the subprocess: interpreter, imports, load, calibration, GPTQ, write) and "in-process" (llmctl:
   its report's wall_time_s, which includes its lazy imports; llm-compressor: load + oneshot +
   save, its imports reported apart as import_s). llm-compressor's log is kept next to its output.

    python -m venv /work/venvs/llmc && /work/venvs/llmc/bin/pip install torch==2.13.0 \\
        && /work/venvs/llmc/bin/pip install -c <(echo torch==2.13.0) llmcompressor
    LLMC_PYTHON=/work/venvs/llmc/bin/python python benchmarks/bench_quant.py --threads 2 \\
        --gptq-smollm --json bench_quant.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHARED, environment, measure_machine, random_model_folder  # noqa: E402

CACHE = Path(os.environ.get("LLMCTL_BENCH_CACHE", "/tmp/llmctl-bench"))
REPO = Path(__file__).resolve().parent.parent
TS_MODEL = SHARED / "models" / "tinyshakespeare-5m"
TEXT = SHARED / "data" / "tinyshakespeare.txt"


# ---------------------------------------------------------------- helpers


def llmctl_cli(args: list[str], threads: int) -> tuple[float, subprocess.CompletedProcess]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "llmctl.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    return time.perf_counter() - t0, res


def choose_group(folder: Path, wanted: int) -> tuple[int, str | None]:
    """The group size llmctl quantize accepts for every linear (its own rule), nearest <= wanted."""
    from llmctl.runtime.formats.spec import working_group_sizes

    c = json.loads((folder / "config.json").read_text())
    widths = [
        c["hidden_size"],
        c["num_attention_heads"] * c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
        c["intermediate_size"],
    ]
    ok = working_group_sizes(widths)
    if wanted in ok:
        return wanted, None
    g = max([x for x in ok if x <= wanted] or ok)
    return g, (
        f"--group-size {wanted} does not divide input widths {sorted(set(widths))}: llmctl "
        "quantize refuses it "
        f"(group sizes that work: {', '.join(map(str, ok))}); using {g}"
    )


def token_files() -> tuple[Path, Path, list[int]]:
    """(calibration JSONL = first 90% of the text's tokens, 4-token stub JSONL, held-out last
    10%)."""
    from llmctl.runtime.tokenizer import load_tokenizer

    ids = list(load_tokenizer(TS_MODEL).encode(TEXT.read_text()))
    cut = int(len(ids) * 0.9)
    calib, stub = CACHE / "tinyshakespeare-ts5m-calib.jsonl", CACHE / "stub-4-tokens.jsonl"
    CACHE.mkdir(parents=True, exist_ok=True)
    if not calib.exists():
        calib.write_text(json.dumps({"prompt_token_ids": ids[:cut]}) + "\n")
    stub.write_text(json.dumps({"prompt_token_ids": [1, 2, 3, 4]}) + "\n")
    return calib, stub, ids[cut:]


def calibration_ids(model: Path, calib: Path, stub: Path, n: int, seq_len: int) -> torch.Tensor:
    """The exact sequences `llmctl quantize --calib calib --eval-data stub` calibrates on."""
    from llmctl.compress.calib_data import load_calibration
    from llmctl.models.config import ModelConfig
    from llmctl.runtime.tokenizer import read_generation_eos

    eos = read_generation_eos(model, ModelConfig.from_file(model / "config.json"))
    return load_calibration(
        calib,
        None,
        num_samples=n,
        seq_len=seq_len,
        eval_data=stub,
        separator=eos[0] if eos else None,
    ).input_ids


# ---------------------------------------------------------------- 1. decode


def rtn_int4_folder(base: Path, group: int, stub: Path, threads: int) -> Path:
    out = CACHE / f"{base.name}-rtn-w4g{group}"
    if (out / "recipe.yaml").exists():
        return out
    _, res = llmctl_cli(
        [
            "quantize",
            str(base),
            "-o",
            str(out),
            "--rtn",
            "--bits",
            "4",
            "--group-size",
            str(group),
            "--calib",
            str(stub),
            "--eval-data",
            str(stub),
            "--num-samples",
            "1",
            "--seq-len",
            "2",
            "--device",
            "cpu",
            "--overwrite",
            "--quiet",
        ],
        threads,
    )
    if res.returncode:
        raise RuntimeError(f"llmctl quantize --rtn failed:\n{res.stderr[-3000:]}")
    return out


def kernel_usage(model) -> dict:
    from llmctl.models.qlinear import QuantLinear, _int4_block_rows

    per: dict[
        str, list[int]
    ] = {}  # projection name -> [linears on the int4 kernel, quantized linears]
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            counts = per.setdefault(name.rsplit(".", 1)[-1], [0, 0])
            counts[0] += m.use_int4_kernel
            counts[1] += 1
    used = sum(u for u, _ in per.values())
    return {
        "int4_kernel_linears": used,
        "quant_linears": sum(t for _, t in per.values()),
        "by_projection": {k: f"{u}/{t}" for k, (u, t) in per.items()},
        "int4_block_rows": _int4_block_rows(),
    }


def weight_bytes_per_decode_step(model) -> int:
    """Bytes of weights one decode step reads: every linear (packed or dense) and lm_head; norms;
    one embedding row (negligible, not counted)."""
    from llmctl.models.qlinear import QuantLinear

    seen, total = set(), 0
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            parts = [m.qweight] + ([m.scale_zeros] if m.use_int4_kernel else [m.scales, m.zeros])
        elif isinstance(m, torch.nn.Linear) or "norm" in name.rsplit(".", 1)[-1]:
            parts = [m.weight]
        else:
            continue
        parts += [m.bias] if getattr(m, "bias", None) is not None else []
        for t in parts:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def decode_bench(
    folder: Path,
    prompt_len: int,
    tokens: int,
    repeats: int,
    bandwidth_gbs: float,
    dtype: str = "bfloat16",
) -> dict:
    from llmctl import LLM, SamplingParams  # load_runtime + LLMEngine

    llm = LLM(str(folder), dtype=dtype, device="cpu", max_num_seqs=1, enable_prefix_caching=False)
    vocab = llm.runtime.config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(
        [torch.randint(10, vocab, (16,), generator=g).tolist()],
        SamplingParams(max_tokens=4, ignore_eos=True),
    )
    ttft, tpot = [], []
    for _ in range(repeats):  # one request at a time: batch 1, a fresh prompt each time
        r = llm.generate([torch.randint(10, vocab, (prompt_len,), generator=g).tolist()], params)[0]
        ttft.append(r.ttft)
        tpot.append(r.tpot)
    model = llm.runtime.model
    wbytes = weight_bytes_per_decode_step(model)
    tok_s = 1 / statistics.median(tpot)
    return {
        "ttft_s": statistics.median(ttft),
        "decode_tok_s": tok_s,
        "decode_tok_s_all": [1 / t for t in tpot],
        "weight_bytes_per_step": wbytes,
        "weight_gbs": wbytes * tok_s / 1e9,
        "mbu": wbytes * tok_s / (bandwidth_gbs * 1e9),
        **kernel_usage(model),
    }


def decode_section(args, machine: dict, stub: Path) -> dict:
    base = random_model_folder(args.config)
    group, note = choose_group(base, args.group_size)
    if note:
        print(f"note: {note}", flush=True)
    int4 = rtn_int4_folder(base, group, stub, args.threads)
    out = {
        "config": args.config,
        "group_size": group,
        "group_note": note,
        "prompt_len": args.prompt_len,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
    }
    for dtype in args.dtypes.split(","):
        short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[dtype]
        for name, folder in ((short, base), (f"int4_{short}", int4)):
            out[name] = decode_bench(
                folder,
                args.prompt_len,
                args.decode_tokens,
                args.repeats,
                machine["memory_read_gbs"],
                dtype,
            )
            r = out[name]
            print(
                f"{name}: TTFT {r['ttft_s'] * 1e3:.1f} ms, decode {r['decode_tok_s']:.1f} tok/s, "
                f"{r['weight_bytes_per_step'] / 1e6:.1f} MB/step, MBU {r['mbu']:.0%}",
                flush=True,
            )
        u = out[f"int4_{short}"]
        print(
            f"int4 kernel: {u['int4_kernel_linears']}/{u['quant_linears']} linears "
            f"{u['by_projection']} "
            f"(layout row block {u['int4_block_rows']})",
            flush=True,
        )
        speed = out[f"decode_speedup_int4_over_{short}"] = (
            u["decode_tok_s"] / out[short]["decode_tok_s"]
        )
        ttft = out[f"ttft_ratio_int4_over_{short}"] = u["ttft_s"] / out[short]["ttft_s"]
        print(
            f"int4 / {short} decode speedup {speed:.2f}x, TTFT ratio {ttft:.2f} (activations in "
            f"{dtype})",
            flush=True,
        )
    return out


# ---------------------------------------------------------------- 2. GPTQ time


def llmctl_gptq(base: Path, out: Path, group: int, calib: Path, stub: Path, args) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # no resume from an earlier run
    report = out.with_suffix(".report.json")
    wall, res = llmctl_cli(
        [
            "quantize",
            str(base),
            "-o",
            str(out),
            "--gptq",
            "--bits",
            "4",
            "--group-size",
            str(group),
            "--calib",
            str(calib),
            "--eval-data",
            str(stub),
            "--num-samples",
            str(args.num_samples),
            "--seq-len",
            str(args.seq_len),
            "--device",
            "cpu",
            "--report-json",
            str(report),
            "--quiet",
        ],
        args.threads,
    )
    if res.returncode:
        return {"error": res.stderr[-3000:]}
    r = json.loads(report.read_text())
    return {"process_s": wall, "quantize_s": r["wall_time_s"], "calibration": r["calibration"]}


def llmc_gptq(python: str, base: Path, out: Path, group: int, ids: torch.Tensor, args) -> dict:
    if not Path(python).exists():
        return {"error": f"LLMC_PYTHON {python} not found (see the docstring to create the venv)"}
    shutil.rmtree(out, ignore_errors=True)
    spec = {
        "model": str(base),
        "tokenizer": str(TS_MODEL),
        "output": str(out),
        "input_ids": ids.tolist(),
        "bits": 4,
        "group_size": group,
        "threads": args.threads,
        "dampening": 0.01,
        "actorder": None,  # llmctl's default (act-order off), with MSE ranges as llmctl's
        "observer": "mse",
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    t0 = time.perf_counter()
    res = subprocess.run(
        [python, str(Path(__file__).with_name("llmc_worker.py")), f.name],
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.perf_counter() - t0
    os.unlink(f.name)
    log = out.with_name(out.name + ".log")
    log.write_text(res.stderr)  # llm-compressor's own log: pipeline, modules, per-module GPTQ times
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return {"process_s": wall, "log": str(log), **json.loads(line[7:])}
    return {
        "error": f"worker exited {res.returncode} without a result: {res.stderr[-2000:]}",
        "log": str(log),
    }


def heldout_ppl(folder: Path, heldout: list[int], seq_len: int) -> float | str:
    from llmctl.runtime.evaluate import perplexity
    from llmctl.runtime.loader import load_runtime

    try:
        model = load_runtime(str(folder), dtype="float32", device="cpu").model
        return perplexity(model, heldout, seq_len=seq_len, stride=seq_len).perplexity
    except Exception as e:  # e.g. a checkpoint llmctl cannot load: record it, keep going
        return f"{type(e).__name__}: {e}"


def gptq_section(name: str, base: Path, calib: Path, stub: Path, heldout: list[int], args) -> dict:
    group, note = choose_group(base, args.group_size)
    if note:
        print(f"note ({name}): {note}", flush=True)
    ids = calibration_ids(base, calib, stub, args.num_samples, args.seq_len)
    out = {
        "model": str(base),
        "group_size": group,
        "group_note": note,
        "num_samples": ids.shape[0],
        "seq_len": ids.shape[1],
    }
    dirs = {"llmctl": CACHE / f"{name}-gptq-llmctl", "llm_compressor": CACHE / f"{name}-gptq-llmc"}
    out["llmctl"] = llmctl_gptq(base, dirs["llmctl"], group, calib, stub, args)
    out["llm_compressor"] = llmc_gptq(
        os.environ.get("LLMC_PYTHON", "/work/venvs/llmc/bin/python"),
        base,
        dirs["llm_compressor"],
        group,
        ids,
        args,
    )
    for side in ("llmctl", "llm_compressor"):
        r = out[side]
        if "error" in r:
            print(f"{name} {side}: FAILED: {r['error']}", flush=True)
        else:
            print(
                f"{name} {side}: whole command {r['process_s']:.1f} s, in-process "
                f"{r['quantize_s']:.1f} s",
                flush=True,
            )
    if "error" not in out["llmctl"] and "error" not in out["llm_compressor"]:
        a, b = out["llm_compressor"], out["llmctl"]
        out["llmctl_speedup"] = {
            "command": a["process_s"] / b["process_s"],
            "in_process": a["quantize_s"] / b["quantize_s"],
        }
        print(
            f"{name}: llmctl speedup over llm-compressor {out['llmctl_speedup']['command']:.2f}x "
            "whole command, "
            f"{out['llmctl_speedup']['in_process']:.2f}x in-process",
            flush=True,
        )
    if args.eval_tokens:
        text = heldout[: args.eval_tokens]
        out["heldout_tokens"] = len(text)
        out["perplexity"] = {"base": heldout_ppl(base, text, args.seq_len)}
        for side in ("llmctl", "llm_compressor"):
            if "error" not in out[side]:
                out["perplexity"][side] = heldout_ppl(dirs[side], text, args.seq_len)
        print(f"{name}: held-out perplexity ({len(text)} tokens) {out['perplexity']}", flush=True)
    return out


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config", default="smollm2-135m", help="shared/configs shape for the decode test"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--group-size",
        type=int,
        default=128,
        help="wanted; the largest size <= it that llmctl accepts is used",
    )
    ap.add_argument(
        "--dtypes",
        default="bfloat16,float32",
        help="activation dtypes: the dense model and the int4 model are each decoded in every one",
    )
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument(
        "--repeats", type=int, default=3, help="batch-1 requests per model (medians reported)"
    )
    ap.add_argument("--num-samples", type=int, default=128, help="GPTQ calibration sequences")
    ap.add_argument(
        "--seq-len",
        type=int,
        default=512,
        help="GPTQ calibration sequence length (and perplexity window)",
    )
    ap.add_argument(
        "--eval-tokens", type=int, default=32768, help="held-out tokens for perplexity (0: skip)"
    )
    ap.add_argument(
        "--gptq-smollm", action="store_true", help="also time GPTQ on the random smollm2-135m shape"
    )
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-gptq", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report = {"environment": environment(), "args": vars(args)}
    calib, stub, heldout = token_files()
    if not args.skip_decode:
        report["machine"] = measure_machine()  # for MBU, measured in this run
        print(f"machine: {report['machine']}", flush=True)
        report["decode"] = decode_section(args, report["machine"], stub)
    if not args.skip_gptq:
        report["gptq"] = {
            "tinyshakespeare-5m": gptq_section(
                "tinyshakespeare-5m", TS_MODEL, calib, stub, heldout, args
            )
        }
        if args.gptq_smollm:
            base = random_model_folder("smollm2-135m")
            report["gptq"]["smollm2-135m"] = gptq_section(
                "smollm2-135m", base, calib, stub, heldout, args
            )
    print(json.dumps(report, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
