"""run-batch's terminal: a Rich progress bar and the summary table, both on stderr.

Owns: `RichUI`, the `llmctl.batch.driver.BatchUI` the command passes to the runner (stdout may
carry the rows, so nothing here writes it); everything is silent with --quiet.
"""

from __future__ import annotations


class RichUI:
    """Progress bar and messages on stderr; everything silent with --quiet."""

    def __init__(self, quiet: bool):
        from rich.console import Console

        self.quiet = quiet
        self.console = Console(stderr=True)
        self._bar = None
        self._task = None

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def start(self, rows_total: int | None, rows_done: int) -> None:
        if self.quiet:
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
