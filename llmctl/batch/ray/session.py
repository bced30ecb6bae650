"""`run-batch --ray`: the job on Ray Data, with the driver as the only writer of the output.

Owns: the pipeline (`processor.read_rows` -> `map_batches` over an actor pool of `Replica`s, one
engine each) with its Ray Data settings, and `RayJobSession`, the driver's side: a `JobSession`
whose rows are served by the replicas and written by a `loop.RayLoop`, which keeps the summary,
progress and `--max-errors` and commits the state through the single-process session's code, so
resume and exactly-once are that session's. A replica killed mid-batch loses only rows the driver
never wrote; Ray retries the batch, and a rerun of a killed job continues from the last commit.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from typing import Iterator

from llmctl.batch.options import RayOptions
from llmctl.batch.ray.cluster import RayCluster
from llmctl.batch.ray.loop import RayLoop
from llmctl.batch.ray.processor import ReadSpec, Replica, ReplicaSpec, read_rows
from llmctl.batch.session import JobSession
from llmctl.batch.summary import BatchStats
from llmctl.batch.uris import is_uri


@contextmanager
def _data_context(ray, ordered: bool, batch_rows: int) -> Iterator[None]:
    """Ray Data settings for the job, restored after it: input order kept unless --unordered,
    small blocks (so replicas start before the whole input is read), no Ray progress bars."""
    ctx = ray.data.DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.target_max_block_size)
    saved_bars = ctx.enable_progress_bars
    ctx.execution_options.preserve_order = ordered
    ctx.target_max_block_size = max(1 << 16, 4096 * batch_rows)
    ctx.enable_progress_bars = False
    log = logging.getLogger("ray.data")  # its per-run INFO lines would draw over our progress
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        ctx.execution_options.preserve_order, ctx.target_max_block_size = saved
        ctx.enable_progress_bars = saved_bars
        log.setLevel(level)


def pipeline(ray, read: ReadSpec, replica: ReplicaSpec, r: RayOptions):
    """The job's Dataset: one reading task (on this node for a local path; anywhere for a URI),
    then the rows in blocks of `batch_rows` through an actor pool of `r.replicas` engines."""
    here = (
        None if is_uri(read.input) else {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    )
    ds = ray.data.from_items([{"seed": 0}]).map_batches(
        read_rows, fn_kwargs={"spec": read}, batch_format="pyarrow", num_cpus=0, label_selector=here
    )
    return ds.repartition(target_num_rows_per_block=r.batch_rows).map_batches(
        Replica,
        fn_constructor_kwargs={"spec": replica},
        batch_size=r.batch_rows,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=r.replicas),
        num_cpus=r.cpus_per_replica,
        num_gpus=r.gpus_per_replica or None,
    )


@dataclasses.dataclass
class RayJobSession(JobSession):
    """A `JobSession` whose rows are served by Ray replicas; `drive` gets the `RayCluster`."""

    def drive(self, sink, runtime: RayCluster, engine=None) -> BatchStats:
        state, opts, r = self.state, self.opts, self.opts.ray
        stats = BatchStats.from_state(state.stats)
        stats.input_format = self.source.format
        rows_total = self.source.count_rows()
        read = ReadSpec(
            opts.input, self.source.format, opts.prompt_column, opts.id_column,
            opts.messages_column, state.next_index, state.next_position,
            tuple(state.done_after), r.batch_rows,
        )  # fmt: skip
        replica = ReplicaSpec(
            dataclasses.replace(opts, ray=None), self.engine_config, self.defaults,
            self.source.format, state.created, runtime.load_runtime,
        )  # fmt: skip
        loop = RayLoop(
            sink, stats, self._settings(), state.next_index, state.next_position,
            on_commit=None if self.out is None else self._on_commit(sink),
            on_progress=self.ui.progress, rows_total=rows_total,
        )  # fmt: skip
        if stats.rows:
            self.ui.info(f"resuming {self.out}: {stats.rows} rows already written")
        self.ui.start(rows_total, stats.rows)
        ray = runtime.ray
        try:
            with (
                self._write_errors(lambda: loop.stats.rows),
                _data_context(ray, opts.ordered, r.batch_rows),
            ):
                batches = pipeline(ray, read, replica, r).iter_batches(
                    batch_format="pyarrow", batch_size=None
                )
                return loop.run(batches, self.committed_rows)
        finally:
            self.ui.stop()
            runtime.close()
