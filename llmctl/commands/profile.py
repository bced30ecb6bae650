"""`llmctl profile`: measured sweeps, config-only estimates, machine peaks and CI comparisons.

One command with three forms (the first word decides):
  llmctl profile MODEL [sweep options]            measured sweep through the serving engine
  llmctl profile --estimate MODEL_OR_CONFIG ...   memory / speed estimate from config.json alone
  llmctl profile compare A.json B.json            side-by-side table; exit 1 when B regresses
The work is in llmctl.profiling; this file parses options and prints.
"""

from __future__ import annotations

from pathlib import Path

import typer

from llmctl.commands._options import MODEL_HELP
from llmctl.errors import LlmctlError, UsageError

SWEEP, ESTIMATE, COMPARE, COMMON = (
    "Measured sweep",
    "Estimate (--estimate)",
    "Compare (profile compare A B)",
    "Common",
)

HELP = """Profile a model: measured sweeps, estimates from config.json, and regression checks.

\b
  llmctl profile MODEL [--batch-sizes 1,8,32] [--prompt-lens 128,512] ...
  llmctl profile --estimate MODEL_OR_CONFIG [--dtype int4] [--memory 24GiB]
  llmctl profile compare A.json B.json [--threshold 5%]  (1: B regressed)
  llmctl profile --measure-machine           (cache peaks for MBU and MFU)

\b
Examples:
  llmctl profile --batch-sizes 1,4 --prompt-lens 32 --gen-lens 16 --json run.json --csv run.csv
  llmctl profile --estimate llmctl/data/demo-model/config.json --dtype int4 --seq-len 256 --batch 8 --memory 24GiB --bandwidth 1000
  llmctl profile compare run.json run.json --threshold 10%

MODEL is a local folder or hub id (default: the embedded demo model); --estimate also takes a config.json file.
"""


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(
            f"{option} takes comma-separated positive integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{option} takes comma-separated positive integers, got {text!r}")
    return values


def _resolve_device(device: str) -> str:
    from llmctl.runtime.resolve import resolve_device

    return resolve_device(device)


def register(app: typer.Typer) -> None:
    @app.command("profile", help=HELP, no_args_is_help=False)
    def profile(
        targets: list[str] = typer.Argument(
            None, metavar="MODEL | compare A B", help=MODEL_HELP, show_default=False
        ),
        batch_sizes: str = typer.Option(
            "1,8,32", "--batch-sizes", help="Comma-separated batch sizes.", rich_help_panel=SWEEP
        ),
        prompt_lens: str = typer.Option(
            "128,512",
            "--prompt-lens",
            help="Comma-separated prompt lengths (tokens).",
            rich_help_panel=SWEEP,
        ),
        gen_lens: str = typer.Option(
            "128",
            "--gen-lens",
            help="Comma-separated generation lengths (tokens).",
            rich_help_panel=SWEEP,
        ),
        repeat: int = typer.Option(
            3, "--repeat", min=1, help="Measured repeats per point.", rich_help_panel=SWEEP
        ),
        warmup: int = typer.Option(
            1,
            "--warmup",
            min=0,
            help="Unrecorded warm-up repeats per point.",
            rich_help_panel=SWEEP,
        ),
        csv_path: Path = typer.Option(
            None,
            "--csv",
            help="Write one CSV row per point.",
            rich_help_panel=SWEEP,
            show_default=False,
        ),
        markdown: bool = typer.Option(
            False,
            "--markdown",
            help="Print a Markdown table instead of the rich table.",
            rich_help_panel=SWEEP,
        ),
        plot_path: Path = typer.Option(
            None,
            "--plot",
            help="Write a PNG of throughput and latency vs batch size (needs matplotlib).",
            rich_help_panel=SWEEP,
            show_default=False,
        ),
        device: str = typer.Option(
            "auto",
            "--device",
            help="auto (cuda when present, else cpu), cpu or cuda.",
            rich_help_panel=SWEEP,
        ),
        kv_cache_memory: str = typer.Option(
            None,
            "--kv-cache-memory",
            help="KV-cache size, e.g. 4GiB (default: what the largest point needs).",
            rich_help_panel=SWEEP,
            show_default=False,
        ),
        seed: int = typer.Option(
            0, "--seed", help="Seed of the random prompts.", rich_help_panel=SWEEP
        ),
        estimate: bool = typer.Option(
            False,
            "--estimate",
            help="Estimate from config.json alone (no weights loaded).",
            rich_help_panel=ESTIMATE,
        ),
        group_size: str = typer.Option(
            "auto",
            "--group-size",
            rich_help_panel=ESTIMATE,
            help="int8/int4 group size along the input dimension, by quantize's rule: auto, "
            "channel, or a power of two >= 16 dividing every layer.",
        ),
        kv_dtype: str = typer.Option(
            None,
            "--kv-dtype",
            help="KV element type: bf16, fp16, fp32, fp8, int8 (default: 16-bit).",
            rich_help_panel=ESTIMATE,
            show_default=False,
        ),
        seq_len: int = typer.Option(
            None,
            "--seq-len",
            min=1,
            help="Tokens per sequence (default: max_position_embeddings).",
            rich_help_panel=ESTIMATE,
            show_default=False,
        ),
        batch: int = typer.Option(
            1, "--batch", min=1, help="Concurrent sequences.", rich_help_panel=ESTIMATE
        ),
        memory: str = typer.Option(
            None,
            "--memory",
            help="Memory budget, e.g. 24GiB: how many sequences fit next to the weights.",
            rich_help_panel=ESTIMATE,
            show_default=False,
        ),
        bandwidth: str = typer.Option(
            None,
            "--bandwidth",
            help="Memory bandwidth in GB/s (e.g. 900 or 3.35TB/s) for the decode ceiling (default: this machine's, if measured).",
            rich_help_panel=ESTIMATE,
            show_default=False,
        ),
        quantize_embeddings: bool = typer.Option(
            False,
            "--quantize-embeddings",
            help="Count embeddings and lm_head at the int dtype too.",
            rich_help_panel=ESTIMATE,
        ),
        threshold: str = typer.Option(
            "5%",
            "--threshold",
            help="Allowed change before B counts as a regression.",
            rich_help_panel=COMPARE,
        ),
        stat: str = typer.Option(
            "p50",
            "--stat",
            help="Statistic compared: mean, p50, p90 or p99.",
            rich_help_panel=COMPARE,
        ),
        dtype: str = typer.Option(
            "auto",
            "--dtype",
            help="Sweep: auto, bfloat16, float16, float32. Estimate: bf16, fp16, fp32, int8, int4 (auto: the config's).",
            rich_help_panel=COMMON,
        ),
        json_path: Path = typer.Option(
            None,
            "--json",
            help="Write the versioned JSON record here.",
            rich_help_panel=COMMON,
            show_default=False,
        ),
        measure_machine: bool = typer.Option(
            False,
            "--measure-machine",
            help="Measure this machine's memory bandwidth and bf16/float32 matmul peaks now and cache them (for MBU/MFU).",
            rich_help_panel=COMMON,
        ),
        quiet: bool = typer.Option(
            False, "--quiet", "-q", help="No progress output on stderr.", rich_help_panel=COMMON
        ),
    ) -> None:
        targets = targets or []
        _check_outputs(json_path=json_path, csv_path=csv_path, plot_path=plot_path)
        if targets and targets[0] == "compare":
            _run_compare(targets[1:], threshold, stat)
            return
        if len(targets) > 1:
            raise UsageError(
                f"profile takes one MODEL, got {len(targets)} ({' '.join(targets)}); "
                "to compare two records use: llmctl profile compare A.json B.json"
            )
        target = targets[0] if targets else None
        if measure_machine:
            _measure(_resolve_device(device), quiet)
            if target is None and not estimate:
                return
        if estimate:
            if target is None:
                raise UsageError("--estimate needs a model folder, config.json or hub id")
            _run_estimate(
                target,
                dtype=dtype,
                group_size=group_size,
                kv_dtype=kv_dtype,
                seq_len=seq_len,
                batch=batch,
                memory=memory,
                bandwidth=bandwidth,
                quantize_embeddings=quantize_embeddings,
                json_path=json_path,
            )
            return
        _run_sweep(
            target,
            batch_sizes=_int_list(batch_sizes, "--batch-sizes"),
            prompt_lens=_int_list(prompt_lens, "--prompt-lens"),
            gen_lens=_int_list(gen_lens, "--gen-lens"),
            repeat=repeat,
            warmup=warmup,
            json_path=json_path,
            csv_path=csv_path,
            markdown=markdown,
            plot_path=plot_path,
            dtype=dtype,
            device=_resolve_device(device),
            kv_cache_memory=kv_cache_memory,
            seed=seed,
            quiet=quiet,
        )


def _check_outputs(**paths: Path | None) -> None:
    """--json/--csv/--plot are written after the run: check them before it (parents are created)."""
    from llmctl.compress.output_dir import check_output_file

    for name, path in paths.items():
        check_output_file(path, "--" + name.removesuffix("_path"), create_parents=True)


def _size(n: float | None) -> str:
    """'13.48 GB (12.55 GiB)' for big sizes, '512.00 KiB' for small ones."""
    from llmctl.engine.config import format_bytes

    if n is None:
        return "-"
    return f"{n / 1e9:.2f} GB ({format_bytes(n)})" if n >= 1e8 else format_bytes(n)


def _console(min_width: int = 80):
    """A console at least `min_width` wide, so wide tables stay whole in CI logs and pipes."""
    from rich.console import Console

    console = Console()
    if console.width < min_width:
        console = Console(width=min_width)
    return console


def _print_table(title: str, rows: list[tuple[str, str]]) -> None:
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(justify="right", overflow="fold")
    for k, v in rows:
        table.add_row(k, v)
    _console(110).print(table)


def _measure(device: str, quiet: bool):
    from llmctl.profiling.machine import measure_machine, save_peaks

    if not quiet:
        typer.echo(
            f"measuring memory bandwidth and bf16/float32 matmul peaks on {device} ...", err=True
        )
    peaks = measure_machine(device)
    path = save_peaks(peaks)
    _print_table(
        f"Machine peaks ({peaks.key})",
        [
            ("memory bandwidth", f"{peaks.memory_bandwidth / 1e9:.1f} GB/s"),
            ("bf16 matmul", f"{peaks.matmul_flops_bf16 / 1e12:.3f} TFLOP/s"),
            ("float32 matmul", f"{peaks.matmul_flops_fp32 / 1e12:.3f} TFLOP/s"),
            ("cached in", str(path)),
        ],
    )
    return peaks


def _default_peaks():
    """Cached peaks of the machine a user most likely means: its GPU when present, else its CPU."""
    import torch

    from llmctl.profiling.machine import cached_peaks

    return cached_peaks("cuda" if torch.cuda.is_available() else "cpu")


def _run_estimate(
    target: str,
    *,
    dtype: str,
    group_size: str,
    kv_dtype: str | None,
    seq_len: int | None,
    batch: int,
    memory: str | None,
    bandwidth: str | None,
    quantize_embeddings: bool,
    json_path: Path | None,
) -> None:
    from llmctl.engine.config import format_bytes, parse_bytes
    from llmctl.profiling import estimate as est
    from llmctl.profiling.environment import environment
    from llmctl.profiling.report import write_json

    config, source = est.find_config(target)
    weight_dtype = dtype
    if dtype == "auto":  # the checkpoint's own dtype, when it names one we know
        named = str(config.torch_dtype or "").replace("torch.", "")
        weight_dtype = (
            named
            if named in est.WEIGHT_BITS or named in ("float32", "bfloat16", "float16")
            else "bf16"
        )
    bw, bw_source = (est.parse_bandwidth(bandwidth), "--bandwidth") if bandwidth else (None, None)
    if bw is None:
        peaks = _default_peaks()
        if peaks is not None:
            bw, bw_source = peaks.memory_bandwidth, f"measured on this machine ({peaks.key})"
    est.parse_group_size(group_size)  # a size quantize refuses is refused before anything else
    group, group_note = est.group_size_for(config, group_size, quantize_embeddings)
    e = est.estimate(
        config,
        model=target,
        dtype=weight_dtype,
        group_size=group,
        kv_dtype=kv_dtype,
        seq_len=seq_len,
        batch=batch,
        block_size=16,
        memory_budget=parse_bytes(memory) if memory else None,
        bandwidth=bw,
        quantize_embeddings=quantize_embeddings,
    )
    w = e.weights
    fmt = e.dtype + (
        f" (group {e.group_size})"
        if e.group_size
        else " (per channel)"
        if e.dtype.startswith("int")
        else ""
    )
    rows = [
        ("config", source),
        ("parameters", f"{e.num_parameters:,} ({e.num_parameters / 1e9:.3f} B)"),
        (f"weights, {fmt}", _size(w.total)),
        ("  linear / scales / zeros", f"{_size(w.linear)} / {_size(w.scales)} / {_size(w.zeros)}"),
        ("  embeddings + lm_head / norms, biases", f"{_size(w.embeddings)} / {_size(w.other)}"),
        (f"KV per token ({e.kv_dtype})", format_bytes(e.kv_bytes_per_token)),
        (f"KV per sequence ({e.seq_len} tokens)", _size(e.kv_bytes_per_sequence)),
        (f"KV for batch {e.batch}", _size(e.kv_bytes_batch)),
        ("weights + KV", _size(e.total_bytes)),
        ("decode FLOPs per token", f"{e.flops_per_token / 1e9:.2f} GFLOP at context {e.seq_len}"),
    ]
    if e.memory_budget is not None:
        rows.append(
            (
                f"sequences of {e.seq_len} tokens in {format_bytes(e.memory_budget)}",
                f"{e.max_sequences} (weights + KV only; leave room for activations)",
            )
        )
    if e.bandwidth is not None:
        rows += [
            ("bandwidth", f"{e.bandwidth / 1e9:.1f} GB/s, {bw_source}"),
            ("decode ceiling per sequence", f"{e.decode_tokens_per_s_per_sequence:,.1f} tokens/s"),
            (
                f"decode ceiling, batch {e.batch}",
                f"{e.decode_tokens_per_s_aggregate:,.1f} tokens/s",
            ),
        ]
    else:
        rows.append(
            ("decode ceiling", "pass --bandwidth GB/s (or run --measure-machine) for tokens/s")
        )
    if group_note and e.dtype.startswith("int"):
        rows.append(("group size", group_note))
    _print_table(f"Estimate: {target}", rows)
    if json_path:
        record = {
            "schema": "llmctl.profile.estimate",
            "schema_version": 1,
            "source": source,
            "environment": environment("none", e.dtype),
            "bandwidth_source": bw_source,
            "formulas": est.ESTIMATE_FORMULAS,
            "estimate": e.to_dict(),
            "group_size_note": group_note,
        }
        from llmctl.compress.output_dir import writing

        with writing(f"--json {json_path}"):
            write_json(record, json_path)


def _run_compare(files: list[str], threshold: str, stat: str) -> None:
    """Print the table; raise LlmctlError (exit 1) when B regresses beyond the threshold."""
    from rich.table import Table

    from llmctl.profiling.compare import compare_records, environment_differences, parse_threshold
    from llmctl.profiling.report import load_record

    if len(files) != 2:
        raise UsageError("usage: llmctl profile compare A.json B.json [--threshold 5%]")
    a, b = load_record(Path(files[0])), load_record(Path(files[1]))
    result = compare_records(a, b, parse_threshold(threshold), stat)
    table = Table(
        title=f"{files[0]} (A) vs {files[1]} (B), {stat}, threshold {result.threshold:.1%}",
        title_justify="left",
    )
    for col in ("batch", "prompt", "gen", "metric", "better", "A", "B", "B/A", ""):
        table.add_column(col, justify="left" if col in ("metric", "better", "") else "right")
    for d in result.deltas:
        ratio = d.ratio
        verdict = "[red]REGRESSION[/red]" if d.regression else ""
        table.add_row(
            *(str(x) for x in d.point),
            d.metric,
            "lower" if d.lower_is_better else "higher",
            _num(d.a),
            _num(d.b),
            "-" if ratio is None else f"{ratio:.3f}",
            verdict,
        )
    console = _console(120)
    console.print(table)
    for label, keys in (("only in A", result.only_in_a), ("only in B", result.only_in_b)):
        if keys:
            console.print(
                f"{label} (not compared): "
                + ", ".join(f"batch {k[0]}/prompt {k[1]}/gen {k[2]}" for k in keys)
            )
    differences = environment_differences(a, b)
    if differences:
        console.print(
            "note: the records come from different environments: " + "; ".join(differences)
        )
    if not result.deltas:
        raise UsageError("the two records share no (batch, prompt, gen) point; nothing to compare")
    n = len(result.regressions)
    if n:
        raise LlmctlError(f"{n} regression(s) of B beyond {result.threshold:.1%} ({stat})")
    typer.echo(f"no regression beyond {result.threshold:.1%} ({stat})", err=True)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _run_sweep(
    target: str | None,
    *,
    batch_sizes: list[int],
    prompt_lens: list[int],
    gen_lens: list[int],
    repeat: int,
    warmup: int,
    json_path: Path | None,
    csv_path: Path | None,
    markdown: bool,
    plot_path: Path | None,
    dtype: str,
    device: str,
    kv_cache_memory: str | None,
    seed: int,
    quiet: bool,
) -> None:
    import importlib.util

    import torch

    from llmctl.errors import RequestError
    from llmctl.profiling import report
    from llmctl.profiling.environment import environment
    from llmctl.profiling.machine import cached_peaks
    from llmctl.profiling.sweep import SweepSettings, grid, model_facts, run_sweep
    from llmctl.runtime.loader import load_runtime

    if (
        plot_path is not None and importlib.util.find_spec("matplotlib") is None
    ):  # fail before the sweep
        raise UsageError(
            "--plot needs matplotlib: pip install 'llmctl[plot]' (or pip install matplotlib)"
        )
    longest = max(prompt_lens) + max(gen_lens)
    runtime = load_runtime(target, dtype=dtype, device=device)
    if longest > runtime.config.max_position_embeddings:
        raise UsageError(
            f"prompt + generation length {longest} exceeds the model's context "
            f"({runtime.config.max_position_embeddings} tokens)"
        )
    kv_dtype = {torch.float32: "fp32", torch.float16: "fp16"}.get(runtime.dtype, "bf16")
    engine = runtime.start_engine(
        _engine_config(runtime.config, kv_dtype, max(batch_sizes), longest, kv_cache_memory, seed)
    )
    dtype_name = str(runtime.dtype).replace("torch.", "")
    peaks = cached_peaks(device)
    settings = SweepSettings(
        points=grid(batch_sizes, prompt_lens, gen_lens),
        repeat=repeat,
        warmup=warmup,
        seed=seed,
        vocab_size=runtime.config.vocab_size,
        device=device,
    )

    def progress(i: int, n: int, point) -> None:
        if not quiet and point is not None:
            typer.echo(
                f"[{i + 1}/{n}] batch {point.batch_size}, prompt {point.prompt_len}, gen {point.gen_len}",
                err=True,
            )

    facts = model_facts(runtime.model, runtime.config, kv_dtype)
    try:
        points = run_sweep(engine, settings, facts, peaks, progress)
    except RequestError as e:
        raise UsageError(
            f"the engine refused a sweep request: {e.message} (raise --kv-cache-memory?)"
        ) from None
    record = report.sweep_record(
        model=runtime.model_name,
        environment=environment(device, dtype_name),
        engine=_engine_info(engine, kv_cache_memory),
        settings={
            "batch_sizes": batch_sizes,
            "prompt_lens": prompt_lens,
            "gen_lens": gen_lens,
            "repeat": repeat,
            "warmup": warmup,
            "seed": seed,
        },
        machine_peaks=peaks.to_dict() if peaks else None,
        points=points,
    )
    record["model_facts"] = {
        "num_parameters": runtime.config.num_parameters(),
        "weight_bytes": facts.weight_bytes,
        "kv_bytes_per_token": facts.kv_bytes_per_token,
        "kv_dtype": kv_dtype,
    }
    _write_sweep_files(record, json_path, csv_path, plot_path)
    if markdown:
        typer.echo(report.markdown(record), nl=False)
    else:
        _print_sweep(record)
    if peaks is None and not quiet:
        typer.echo(
            "MBU/MFU need this machine's peaks: run `llmctl profile --measure-machine` once",
            err=True,
        )


def _write_sweep_files(
    record: dict, json_path: Path | None, csv_path: Path | None, plot_path: Path | None
) -> None:
    """--json, --csv and --plot (checked before the sweep); an OS error is one line."""
    from llmctl.compress.output_dir import writing
    from llmctl.profiling import report

    with writing("the profile results"):
        if json_path:
            report.write_json(record, json_path)
        if csv_path:
            report.write_csv(record, csv_path)
        if plot_path:
            report.plot(record, plot_path)


def _engine_config(
    config, kv_dtype: str, max_batch: int, longest: int, kv_cache_memory: str | None, seed: int
):
    """Engine settings for a sweep: every sequence of the largest batch fits in the KV cache at once
    (unless --kv-cache-memory says otherwise) and may run concurrently."""
    from llmctl.engine.config import EngineConfig, parse_bytes
    from llmctl.profiling.estimate import kv_bytes_per_sequence

    block = EngineConfig().block_size
    need = max_batch * kv_bytes_per_sequence(config, longest + block, kv_dtype, block)
    return EngineConfig(
        kv_cache_memory=parse_bytes(kv_cache_memory) if kv_cache_memory else need,
        max_num_seqs=max(max_batch, EngineConfig().max_num_seqs),
        seed=seed,
    )


def _engine_info(engine, kv_cache_memory: str | None) -> dict:
    cfg = engine.engine_config
    return {
        "block_size": cfg.block_size,
        "num_kv_blocks": engine.num_kv_blocks,
        "kv_cache_bytes": engine.kv_cache_bytes,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "kv_cache_sizing": "--kv-cache-memory"
        if kv_cache_memory
        else "largest batch x (prompt + gen + 1 block)",
    }


def _print_sweep(record: dict) -> None:
    from rich.table import Table

    env = record["environment"]
    table = Table(
        title=f"{record['model']} on {env['device']} ({env.get('gpu_name') or env['cpu_model']}), "
        f"{env['dtype']}: p50 over {record['settings']['repeat']} repeats",
        title_justify="left",
    )
    cols = (
        "batch",
        "prompt",
        "gen",
        "TTFT ms",
        "TPOT ms",
        "e2e s",
        "decode tok/s",
        "tok/s/seq",
        "prefill tok/s",
        "peak MiB",
        "KV blocks",
        "MBU",
        "MFU",
    )
    for c in cols:
        table.add_column(c, justify="right")

    def p50(p: dict, m: str, scale: float = 1.0, fmt: str = ".1f") -> str:
        v = (p.get(m) or {}).get("p50")
        return "-" if v is None else format(v * scale, fmt)

    for p in record["points"]:
        mem = p.get("peak_memory_bytes")
        table.add_row(
            str(p["batch_size"]),
            str(p["prompt_len"]),
            str(p["gen_len"]),
            p50(p, "ttft_s", 1e3, ".2f"),
            p50(p, "tpot_s", 1e3, ".2f"),
            p50(p, "e2e_s", 1, ".3f"),
            p50(p, "decode_tokens_per_s"),
            p50(p, "decode_tokens_per_s_per_sequence"),
            p50(p, "prefill_tokens_per_s"),
            "-" if mem is None else f"{mem / 2**20:.0f}",
            str(p.get("kv_blocks_used") or "-"),
            "-" if p.get("mbu") is None else f"{p['mbu']:.1%}",
            "-" if p.get("mfu") is None else f"{p['mfu']:.1%}",
        )
    _console(140).print(table)
