"""`profile advise`: the user's workload, and one measured pass of it through the engine.

Owns: `AdviseRequest` (every advise option and its default), `AdviseTools`, reading a sample of
the workload with run-batch's parsing (its `open_input`, rows tokenized as run-batch does), the
share of prompt tokens a shared prefix covers, and `measure` (the sample through fresh engines at
the workload's concurrency, greedy with `ignore_eos` so every trial produces the same token count,
a few passes with each request's best kept: load from other processes only ever adds time).
Which trials run and how they rank is in `advise_trials`; the record and table in
`advise_report`.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from llmctl.engine.params import RequestOutput, SamplingParams
from llmctl.errors import RequestError, UsageError
from llmctl.profiling.environment import peak_memory, reset_peak_memory
from llmctl.profiling.sweep import summarize

OBJECTIVES = ("throughput", "ttft", "tpot", "memory")


@dataclass(frozen=True)
class AdviseRequest:
    """The options of one advise run (the command passes the ones a user set)."""

    workload: str
    objective: str = "throughput"
    sample: int = 64
    budget: str = "10m"
    max_tokens: int = 64  # per request, unless its row says max_tokens
    concurrency: int | None = None  # requests in flight at once; None: the whole sample
    draft: str | None = None
    calib: str | None = None  # calibration text: GPTQ and AWQ trials besides RTN
    quality_data: str | None = None
    max_kl: float = 0.05
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    repeats: int = 3  # fresh-engine passes per measurement; each request keeps its best
    confirm_rounds: int = 3  # the printed commands, run in fresh processes, alternated; 0: off

    def check(self) -> None:
        """Every check that needs no model: one-line errors before any work."""
        if self.objective not in OBJECTIVES:
            raise UsageError(
                f"unknown --objective {self.objective!r}; use one of {', '.join(OBJECTIVES)}"
            )
        if self.sample < 1 or self.max_tokens < 1 or self.repeats < 1:
            raise UsageError("--sample, --max-tokens and --repeat must be >= 1")
        if self.confirm_rounds < 0:
            raise UsageError(f"--confirm-rounds must be >= 0, got {self.confirm_rounds}")
        for flag, path in (("--calib", self.calib), ("--quality-data", self.quality_data)):
            if path is not None and not Path(path).is_file():
                raise UsageError(f"{flag} {path}: no such file")
        if self.concurrency is not None and self.concurrency < 1:
            raise UsageError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.max_kl < 0:
            raise UsageError(f"--max-kl must be >= 0, got {self.max_kl}")
        parse_duration(self.budget)


def parse_duration(text: str) -> float:
    """'10m' -> 600.0; '90s', '1h', '1.5m' and plain seconds are read too."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h)?\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"cannot read --budget {text!r}; use a duration such as 10m, 90s or 1h")
    scale = {None: 1, "s": 1, "m": 60, "min": 60, "h": 3600}[m.group(2)]
    return float(m.group(1)) * scale


@dataclass
class Workload:
    """The tokenized sample: prompts [n][len] and each request's output length."""

    prompts: list[list[int]]
    max_tokens: list[int]
    rows_read: int
    rows_refused: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass(frozen=True)
class AdviseTools:
    """What advise borrows from its peers, passed in by the command (profiling imports neither
    batch nor compress): run-batch's `open_input(path)` (a row source), quantize's one-shot
    pipeline `quantize(model_path, output_folder, bits, method, calib)` (method rtn, gptq or awq;
    calib: a text file or None), `load_runtime`, and `run_line(args)`: one `llmctl` command line
    (the words after `llmctl`) in a fresh process, returning its --report-json record and the
    process's peak resident memory in bytes (None where unknown)."""

    open_input: Callable[[str], Any]
    quantize: Callable[[str, str, int, str, str | None], None]
    load_runtime: Callable[..., Any]
    run_line: Callable[[list[str]], tuple[dict, int | None]]


def read_rows(open_input: Callable[[str], Any], path: str, sample: int) -> tuple[list[Any], int]:
    """The first `sample` servable rows of the workload (run-batch's parsing) and the count of
    refused rows; a missing, unreadable or empty workload is a UsageError."""
    source = open_input(path)
    rows, refused = [], 0
    try:
        for row in source.rows():
            if row.error is not None:
                refused += 1
                continue
            rows.append(row)
            if len(rows) == sample:
                break
    finally:
        source.close()
    if not rows:
        why = f" ({refused} row(s) refused)" if refused else ""
        raise UsageError(f"the workload {path} has no servable prompt{why}")
    return rows, refused


def tokenize(rows: list[Any], runtime: Any, default_max_tokens: int) -> Workload:
    """Rows -> token ids as run-batch tokenizes them (token ids, chat messages or text)."""
    prompts, lengths = [], []
    for row in rows:
        if row.prompt_token_ids is not None:
            ids = list(row.prompt_token_ids)
        elif row.messages is not None:
            ids = list(runtime.apply_chat_template(row.messages))
        else:
            ids = list(runtime.encode(row.prompt))
        if ids:
            prompts.append(ids)
            lengths.append(int(row.overrides.get("max_tokens") or default_max_tokens))
    if not prompts:
        raise UsageError("every sampled workload prompt encodes to no tokens")
    return Workload(prompts, lengths, len(rows), 0)


def shared_prefix_tokens(prompts: list[list[int]], block_size: int) -> int:
    """Prompt tokens a prefix cache could reuse: for each prompt, its longest common prefix with
    an earlier prompt, rounded down to whole KV blocks (the cache shares full blocks only)."""
    total = 0
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            for a, b in zip(p, q):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        total += min(best, len(p) - 1) // block_size * block_size
    return total


@dataclass
class Measurement:
    """The sample's measured passes combined: per-request metric summaries (each request's best
    TTFT and TPOT over the passes), the best pass's throughput, the highest peak memory, and the
    wall time of every pass together."""

    ttft_s: dict | None
    tpot_s: dict | None
    output_tokens_per_s: float | None
    peak_memory_bytes: int | None
    wall_s: float
    passes: int = 1
    preemptions: int = 0  # sequences the engine preempted (KV cache full), most in one pass
    # the first pass's greedy output tokens per request (sample order): what `agreement` compares
    tokens: list[list[int]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "tokens"}


def agreement(base: Measurement, other: Measurement) -> float | None:
    """The share of `base`'s greedy output tokens that `other` matches position by position
    (outputs have the same lengths: the sample ignores EOS): 1.0 for a change that alters no
    token, lower for one that changes the numbers (a quantized KV cache)."""
    if base.tokens is None or other.tokens is None:
        return None
    total = sum(map(len, base.tokens))
    same = sum(x == y for a, b in zip(base.tokens, other.tokens) for x, y in zip(a, b))
    return same / total if total else None


def _drive(engine: Any, work: Workload, concurrency: int) -> tuple[list[RequestOutput], float]:
    """Keep `concurrency` requests in flight (a closed-loop client) until all finish."""
    pending = list(range(len(work.prompts)))[::-1]
    outputs: list[RequestOutput] = []
    in_flight = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            i = pending.pop()
            params = SamplingParams(max_tokens=work.max_tokens[i], temperature=0.0, ignore_eos=True)
            engine.add_request(f"advise-{i}", work.prompts[i], params)
            in_flight += 1
        finished = engine.step()
        in_flight -= len(finished)
        outputs.extend(finished)
    return outputs, time.perf_counter() - start


def warm_up(engine: Any, work: Workload, seed: int) -> None:
    """One random prompt as long as the workload's median, through prefill and a few decode
    steps: first-call costs out of the measured pass, nothing shared with the workload's
    prefixes."""
    rng = random.Random(seed)
    length = sorted(len(p) for p in work.prompts)[len(work.prompts) // 2]
    prompt = [rng.randrange(engine.model_config.vocab_size) for _ in range(length)]
    engine.add_request("advise-warmup", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


PRIME_TOKENS = 4  # output tokens per request of the priming pass: enough for batched decodes


def prime(engine: Any, work: Workload, concurrency: int, seed: int = 1) -> None:
    """Once per advise run, before the first measurement, untimed: every prompt of the sample
    replaced by random tokens of its length (nothing for a prefix cache to share), a few output
    tokens each, at the workload's concurrency. So the batched prefill and decode shapes of the
    workload, and every kernel they reach, have run once before any pass is timed: the first
    measured pass of a process ran systematically slower than the next without it, which the
    output would have stated as noise."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in p] for p in work.prompts]
    _drive(engine, Workload(prompts, [PRIME_TOKENS] * len(prompts), len(prompts), 0), concurrency)


def _best(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def measure(
    start_engine: Callable[[], Any], work: Workload, concurrency: int, device: str, repeats: int = 1
) -> Measurement:
    """The sample through `repeats` fresh engines (each warmed up first; fresh so a prefix
    cache never starts a pass holding the previous one's prompts); engine refusals are one-line
    errors."""
    ttft: dict[str, list] = {}
    tpot: dict[str, list] = {}
    rates, peaks, walls, preempted, tokens = [], [], [], [0], None
    for _ in range(repeats):
        engine = start_engine()
        warm_up(engine, work, 0)
        reset_peak_memory(device)
        try:
            outputs, wall = _drive(engine, work, concurrency)
        except RequestError as e:
            raise UsageError(f"the engine refused a workload request: {e.message}") from None
        for o in outputs:
            ttft.setdefault(o.request_id, []).append(o.ttft)
            tpot.setdefault(o.request_id, []).append(o.tpot)
        if tokens is None:
            order = sorted(outputs, key=lambda o: int(o.request_id.rsplit("-", 1)[1]))
            tokens = [list(o.output_token_ids) for o in order]
        n_out = sum(len(o.output_token_ids) for o in outputs)
        preempted.append(engine.scheduler.num_preemptions)
        rates.append(n_out / wall if wall > 0 else None)
        peaks.append(peak_memory(device)[0])
        walls.append(wall)
    known_peaks = [p for p in peaks if p is not None]
    return Measurement(
        ttft_s=summarize([_best(v) for v in ttft.values()]),
        tpot_s=summarize([_best(v) for v in tpot.values()]),
        output_tokens_per_s=max((r for r in rates if r is not None), default=None),
        peak_memory_bytes=max(known_peaks) if known_peaks else None,
        wall_s=sum(walls),
        passes=repeats,
        preemptions=max(preempted),
        tokens=tokens,
    )
