"""The engine's log lines, on the `llmctl.engine` logger (stdlib logging; silent unless a caller
configures it): every step at DEBUG; the first preemption and, at most every
`EngineConfig.log_stats_interval_s`, a statistics line (steps and step time since the last line,
queue, KV blocks, prefix-cache hit rate, preemptions) at INFO.

Owns: `EngineLog`, which LLMEngine calls once per step with the step's batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("llmctl.engine")


@dataclass
class _LogMarks:
    """Where the last INFO statistics line stood, so the next one reports the steps since."""

    time: float
    steps: int = 0
    model_seconds: float = 0.0
    preempted: bool = False  # the first preemption is logged at INFO, later ones at DEBUG


class EngineLog:
    def __init__(self, now: float):
        self.marks = _LogMarks(now)

    def step(self, engine, batch, seconds: float) -> None:
        """DEBUG: this step; INFO: the first preemption, then statistics at most every interval."""
        if batch.preempted:
            level = logging.DEBUG if self.marks.preempted else logging.INFO
            self.marks.preempted = True
            if log.isEnabledFor(level):
                log.log(
                    level,
                    "preempted %d sequence(s): KV cache full (%d of %d blocks in use); they are "
                    "recomputed when blocks free up",
                    len(batch.preempted),
                    engine.block_manager.num_used_blocks,
                    engine.block_manager.num_blocks,
                )
        if log.isEnabledFor(logging.DEBUG):
            decodes = sum(1 for n in batch.num_new_tokens if n == 1)
            log.debug(
                "step %d: %d sequences (%d decoding), %d tokens, %.2f ms",
                engine.stats.steps,
                len(batch.seqs),
                decodes,
                batch.total_tokens,
                seconds * 1000,
            )
        now = time.perf_counter()
        if now - self.marks.time >= engine.engine_config.log_stats_interval_s:
            if log.isEnabledFor(logging.INFO):
                log.info("%s", self._stats_line(engine))
            self.marks.time, self.marks.steps = now, engine.stats.steps
            self.marks.model_seconds = engine.stats.model_seconds

    def _stats_line(self, engine) -> str:
        st, bm, sch, mark = engine.stats, engine.block_manager, engine.scheduler, self.marks
        steps, seconds = st.steps - mark.steps, time.perf_counter() - mark.time
        step_ms = 1000 * (st.model_seconds - mark.model_seconds) / steps if steps else 0.0
        hit = 100 * bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0
        return (
            f"engine: {steps} steps in {seconds:.1f} s ({step_ms:.2f} ms each), "
            f"{len(sch.running)} running, {len(sch.waiting)} waiting, KV blocks "
            f"{bm.num_used_blocks}/{bm.num_blocks} in use; so far a prefix cache hit rate of "
            f"{hit:.1f}% and {sch.num_preemptions} preemptions"
        )
