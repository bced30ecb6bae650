"""run-batch's terminal: progress (a Rich bar, or plain lines for logs), the summary table and
the engine's log lines, all on stderr.

Owns: `RichUI` and `LinesUI`, the `llmctl.batch.session.BatchUI`s the command passes to the
runner (stdout may carry the rows, so nothing here writes it), `make_ui` (--progress, --quiet:
everything silent) and `engine_logging` (a stderr handler on the `llmctl` logger for the
command's duration, at --log-level).
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from typing import Iterator


class RichUI:
    """Progress bar and messages on stderr; everything silent with --quiet."""

    def __init__(self, quiet: bool, bar: bool = True):
        from rich.console import Console

        self.quiet = quiet
        self.console = Console(stderr=True)
        self._bar = None
        self._task = None
        self._show_bar = bar

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def start(self, rows_total: int | None, rows_done: int) -> None:
        if self.quiet or not self._show_bar:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(
            TextColumn("run-batch"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("rows"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[tps]} tok/s, {task.fields[errors]} errors"),
            console=self.console,
            transient=False,
        )
        self._task = self._bar.add_task(
            "rows", total=rows_total, completed=rows_done, tps="-", errors=0
        )
        self._bar.start()

    def progress(self, p) -> None:
        if self._bar is None:
            return
        tps = (
            f"{p.session_output_tokens / p.session_elapsed_s:,.0f}"
            if p.session_elapsed_s > 0
            else "-"
        )
        total = p.rows_total
        if p.finished:
            total = p.rows_done  # the line count behind rows_total includes blank lines
        elif total is not None:
            total = max(total, p.rows_done)
        self._bar.update(self._task, completed=p.rows_done, total=total, tps=tps, errors=p.errors)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def summary(self, s: dict) -> None:
        if self.quiet:
            return
        from rich.table import Table

        def ms(v):
            return "-" if v is None else f"{v * 1000:.3g} ms"

        t = Table(title="run-batch summary", show_header=False, title_justify="left")
        if s.get("input_format"):
            t.add_row("input format", s["input_format"])
        t.add_row("rows", f"{s['rows']:,} ({s['errors']:,} errors)")
        if s["errors_by_code"]:
            t.add_row(
                "errors by code", ", ".join(f"{k}: {v}" for k, v in s["errors_by_code"].items())
            )
        t.add_row("tokens", f"{s['prompt_tokens']:,} prompt, {s['output_tokens']:,} output")
        t.add_row(
            "throughput",
            f"{s['requests_per_s'] or 0:,.2f} requests/s, "
            f"{s['output_tokens_per_s'] or 0:,.1f} output tokens/s",
        )
        for name in ("ttft_s", "tpot_s"):
            t.add_row(name[:4].upper(), "  ".join(f"{k} {ms(v)}" for k, v in s[name].items()))
        so = s["structured_outputs"]
        if so["constrained"]:
            t.add_row(
                "structured outputs",
                f"{so['constrained']:,} constrained: {so['valid']:,} valid, "
                f"{so['incomplete']:,} incomplete, {so['invalid']:,} invalid",
            )
        spec = s["speculative"]
        if spec["proposed_tokens"]:
            t.add_row(
                "speculative",
                f"{spec['accepted_tokens']:,} of {spec['proposed_tokens']:,} draft tokens accepted "
                f"({100 * spec['acceptance_rate']:.1f}%)",
            )
        t.add_row("elapsed", f"{s['elapsed_s']:.1f} s")
        self.console.print(t)
        self.info("output: " + ("stdout" if s["output"] == "-" else s["output"]))


class LinesUI(RichUI):
    """Progress as a plain line every `interval` seconds (logs of Slurm, Kubernetes, Ray, CI:
    stderr is not a terminal); messages and the summary as RichUI's."""

    def __init__(self, interval_s: float):
        super().__init__(quiet=False, bar=False)
        self.interval_s = interval_s
        self._t0 = self._last = time.perf_counter()
        self._rows_at_start = 0

    def start(self, rows_total: int | None, rows_done: int) -> None:
        self._t0 = self._last = time.perf_counter()
        self._rows_at_start = rows_done

    def progress(self, p) -> None:
        now = time.perf_counter()
        if p.finished or now - self._last < self.interval_s:
            return
        self._last = now
        print(progress_line(p, self._rows_at_start), file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def progress_line(p, rows_at_start: int = 0) -> str:
    """'run-batch: 120/1000 rows (12.0%), 2 errors, 345.6 output tok/s, elapsed 0:00:35, ETA
    0:04:10' (the rate and ETA from this session's rows: a resumed job's earlier rows took no
    time here)."""
    elapsed, done, total = p.session_elapsed_s, p.rows_done, p.rows_total
    tps = p.session_output_tokens / elapsed if elapsed > 0 else 0.0
    rows = f"{done} rows"
    eta = ""
    if total is not None:
        total = max(total, done)
        rows = f"{done}/{total} rows ({100 * done / total if total else 100:.1f}%)"
        rate = (done - rows_at_start) / elapsed if elapsed > 0 else 0.0
        eta = f", ETA {_clock((total - done) / rate)}" if rate > 0 else ", ETA -"
    return (
        f"run-batch: {rows}, {p.errors} errors, {tps:.1f} output tok/s, "
        f"elapsed {_clock(elapsed)}{eta}"
    )


def make_ui(quiet: bool, progress: str, interval_s: float) -> RichUI:
    """The UI for --quiet and --progress (auto: a bar on a terminal, lines otherwise)."""
    if quiet:
        return RichUI(quiet=True)
    if progress == "auto":
        progress = "bar" if sys.stderr.isatty() else "lines"
    if progress == "lines":
        return LinesUI(interval_s)
    return RichUI(quiet=False, bar=progress == "bar")


class _StderrHandler(logging.StreamHandler):
    """Writes to the sys.stderr of the moment (a Rich bar redirects it to print above itself)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


@contextmanager
def engine_logging(level: str) -> Iterator[None]:
    """The `llmctl` logger (the engine's events) on stderr at `level` while the command runs."""
    logger = logging.getLogger("llmctl")
    handler = _StderrHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    previous = logger.level
    logger.setLevel(getattr(logging, level.upper()))
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
