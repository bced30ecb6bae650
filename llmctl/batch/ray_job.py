"""`run-batch --ray`: the job on Ray Data, with the driver as the only writer of the output.

Owns: `connect` (to `--ray-address`, or a local cluster started for the job and stopped after
it), the pipeline (`ray_processor.read_rows` -> `map_batches` over an actor pool of `Replica`s,
one engine each), and `RayJobSession`, the driver's side: it writes the output lines the replicas
return, keeps the summary, progress and `--max-errors`, and commits the state through the
single-process job's code (`JobSession`), so resume and exactly-once are that job's. A replica
killed mid-batch loses only rows the driver never wrote; Ray retries the batch, and a rerun of a
killed job continues from the last commit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from llmctl import errors
from llmctl.batch.driver import JobSession
from llmctl.batch.job import BatchJob, Checkpoint, JobSettings
from llmctl.batch.options import BatchOptions, RayOptions
from llmctl.batch.ray_processor import ReadSpec, Replica, ReplicaSpec, read_rows
from llmctl.batch.summary import BatchStats, Progress
from llmctl.batch.uris import is_uri
from llmctl.errors import AbortedError, LlmctlError, UsageError

EXTRA = "pip install 'llmctl[ray]'"


def import_ray():
    """The `ray` module with Ray Data, or the one-line error naming the extra."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise UsageError(f"--ray needs Ray Data, which is not installed: {EXTRA}") from None
    return ray


@dataclass
class RayCluster:
    """The Ray connection of one job; `close` stops what the job started, nothing else."""

    ray: Any
    load_runtime: Callable[..., Any]
    started: bool

    def close(self) -> None:
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
            self.started = False


def connect(opts: BatchOptions, load_runtime: Callable[..., Any], ui) -> RayCluster:
    """Join the cluster the process is already in, --ray-address, or a new local cluster."""
    r = opts.ray
    if opts.input == "-":
        raise UsageError("--ray reads the input in a Ray task: pass a file, not stdin")
    ray = import_ray()
    if ray.is_initialized():  # embedded use: the caller's cluster, left running
        return RayCluster(ray, load_runtime, started=False)
    quiet = {"logging_level": logging.WARNING, "log_to_driver": False}
    try:
        if r.address is not None:
            ray.init(address=r.address, **quiet)
            ui.info(f"Ray: connected to {r.address}")
        else:
            cpus = math.ceil(r.replicas * r.cpus_per_replica) + 1  # + the reading task
            gpus = math.ceil(r.replicas * r.gpus_per_replica)
            ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, **quiet)
            ui.info(f"Ray: started a local cluster ({cpus} CPUs, {gpus} GPUs) for this job")
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = r.address or "a local cluster"
        raise UsageError(f"cannot start Ray ({where}): {str(e).splitlines()[0]}") from None
    return RayCluster(ray, load_runtime, started=True)


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


_REMOTE_ERROR = re.compile(r"llmctl\.errors\.(\w+): (.+)")


def _llmctl_cause(e: BaseException) -> LlmctlError | None:
    """The llmctl error a Ray error carries (e.g. a replica's model failed to load), if any: an
    actor that died in `__init__` only keeps its error's text, so the text is read back."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, LlmctlError):
            return e
        found = _REMOTE_ERROR.search(str(e))
        kind = getattr(errors, found.group(1), None) if found else None
        if isinstance(kind, type) and issubclass(kind, LlmctlError):
            return kind(found.group(2).strip())
        e = getattr(e, "cause", None) or e.__cause__
    return None


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
        loop = DriverLoop(sink, stats, self._settings(), state.next_index, state.next_position)
        loop.on_commit = None if self.out is None else self._on_commit(sink)
        loop.on_progress, loop.rows_total = self.ui.progress, rows_total
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


class DriverLoop:
    """Writes the rows replicas return, moves the resume point, commits and reports progress.

    The resume point (the first row not yet written, with its position) moves over a row once
    every row before it is written; rows written past it (--unordered) are `done_after` in the
    state, as in a single-process job, so a rerun serves every row exactly once."""

    def __init__(self, sink, stats: BatchStats, settings: JobSettings, index: int, position: int):
        self.sink, self.stats, self.settings = sink, stats, settings
        self.on_commit: Callable[[Checkpoint], None] | None = None
        self.on_progress: Callable[[Progress], None] | None = None
        self.rows_total: int | None = None
        self._next = (index, position)
        self._ahead: dict[int, tuple[int, tuple[int, int]]] = {}  # index_from -> (index, next)
        self._read_position = position
        self._base_elapsed = stats.elapsed_s
        self._since_commit, self._session_tokens, self._busy = 0, 0, False
        self._t0 = self._last_commit = self._last_progress = time.perf_counter()

    def run(self, batches, committed: Callable[[], int]) -> BatchStats:
        self._t0 = self._last_commit = time.perf_counter()
        try:
            for batch in batches:
                for row in batch.to_pylist():
                    self._busy = True
                    self._take(row)
                    self._busy = False
                    self._check_errors()
                self._maybe_commit()
        except (AbortedError, KeyboardInterrupt, OSError):
            if not self._busy:
                self._safe_commit()
            raise
        except Exception as e:  # a Ray failure: keep what was written, one line
            if not self._busy:
                self._safe_commit()
            cause = _llmctl_cause(e)
            if cause is not None:
                raise cause from None
            first = (str(e).strip().splitlines() or [""])[-1]
            raise LlmctlError(
                f"the Ray job failed ({type(e).__name__}: {first}); {committed()} rows are "
                f"committed, rerun the same command to continue"
            ) from None
        self._commit(finished=True)
        self._progress(force=True, finished=True)
        return self.stats

    def _take(self, row: dict) -> None:
        self.stats.spec_proposed += row["spec_proposed"]
        self.stats.spec_accepted += row["spec_accepted"]
        if not row["done"]:
            self.sink.write(row["data"])
            self.stats.add_row(
                row["prompt_tokens"], row["completion_tokens"], row["error_code"],
                row["ttft"], row["tpot"],
            )  # fmt: skip
            self._session_tokens += row["completion_tokens"]
            self._since_commit += 1
        nxt = (row["index"] + 1, row["end_position"])
        self._read_position = max(self._read_position, row["end_position"])
        if row["index_from"] != self._next[0]:
            if self.settings.ordered:
                raise RuntimeError(f"Ray returned row {row['index']} out of input order")
            self._ahead[row["index_from"]] = (row["index"], nxt)
            return
        self._next = nxt
        while self._next[0] in self._ahead:
            self._next = self._ahead.pop(self._next[0])[1]
        self._progress()

    # --max-errors: the single-process rule, over the same attributes (settings, stats, _commit,
    # _progress)
    _check_errors = BatchJob._check_errors

    def _maybe_commit(self) -> None:
        s = self.settings
        if self._since_commit and (
            self._since_commit >= s.commit_rows
            or time.perf_counter() - self._last_commit >= s.commit_interval_s
        ):
            self._commit()

    def _commit(self, finished: bool = False) -> None:
        output_bytes = self.sink.commit()
        self.stats.elapsed_s = self._base_elapsed + (time.perf_counter() - self._t0)
        if self.on_commit is not None:
            self.on_commit(
                Checkpoint(
                    next_index=self._next[0],
                    next_position=self._next[1],
                    done_after=sorted(index for index, _ in self._ahead.values()),
                    read_position=self._read_position,
                    output_bytes=output_bytes,
                    stats=self.stats,
                    finished=finished,
                )
            )
        self._since_commit, self._last_commit = 0, time.perf_counter()

    def _safe_commit(self) -> None:
        try:
            self._commit()
        except Exception:
            pass  # the previous commit stays valid; the original error is what matters

    def _progress(self, force: bool = False, finished: bool = False) -> None:
        now = time.perf_counter()
        if self.on_progress is None or (
            not force and now - self._last_progress < self.settings.progress_interval_s
        ):
            return
        self._last_progress = now
        self.on_progress(
            Progress.of(self.stats, self.rows_total, self._session_tokens, now - self._t0, finished)
        )
