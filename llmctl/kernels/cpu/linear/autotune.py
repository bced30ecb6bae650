"""Linear kernels chosen by measurement: when an engine starts, each distinct linear shape is timed
at a few row counts over every candidate (dispatch.CANDIDATES) that can serve it on this CPU, and
the fastest is used per count.

Owns: the row buckets, the choice rule (`choose`, and one packed copy per shape:
`_rechoose_packed`), the time budget and early stop (`tune`), the per-shape plan a layer consults
per call (`Plan`), and the JSON cache of the choices, one file per CPU model (features.fingerprint)
in llmctl's cache folder (autotune/), keyed per shape by what else decides the timings (threads,
torch, and every source file of the C linear kernels, c_kernels.SOURCES). Rows between buckets
use the nearest bucket's choice (in ratio); a bucket left unmeasured (budget spent) has no choice,
and the static rule (dispatch.static) serves it. The batch-invariant paths (invariant.py) never
consult a plan.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from llmctl.cache_dir import cache_root
from llmctl.kernels.cpu.features import fingerprint
from llmctl.kernels.cpu.linear.c_kernels import SOURCES
from llmctl.kernels.cpu.linear.dispatch import BY_NAME, CANDIDATES, Candidate

BUCKETS = (1, 8, 32, 64, 128)  # and the caller's largest row count (the token budget)
BUDGET_S = 6.0  # wall seconds of timing per model at most
DROP_RATIO = 3.0  # a few-rows kernel this much slower than a bucket's best: not timed above it
MEMORY_MARGIN = 1.2  # a packed copy (more memory) must beat the best plain kernel by this much
# Packed copies double the memory of the linears they serve: only where all the tuned weights
# together are at most this large (a model of a few hundred million parameters).
PACK_MAX_BYTES = 1 << 30
# 2: bucket 64, timings over TIMED_LAYERS weights; 3: a shape packed once is packed where fastest;
# 4: ROUNDS interleaved measurements; 5: the AMX candidate; 6: timed in passes over weights
CACHE_VERSION = 6
MAX_CALLS, MIN_SECONDS = 8, 0.004  # timed calls per measurement: at most; seconds to stop
PASS_CALLS = 4  # calls per timed pass (each over another weight)
# Measurements per candidate and bucket, taken in turn with the other candidates and averaged: on
# a VM whose memory bandwidth drifts (seen 38-67 GB/s within an hour, AMD EPYC Zen 5), one block
# per candidate let the drift pick the kernel (choices flipped between runs).
ROUNDS = 2


def buckets(max_rows: int) -> tuple[int, ...]:
    """The row counts timed for layers that see at most `max_rows` rows."""
    return tuple(sorted({b for b in BUCKETS if b < max_rows} | {max(1, max_rows)}))


def nearest(rows: int, measured: Sequence[int]) -> int:
    """The bucket nearest `rows` in ratio (ties: the smaller); `measured` non-empty."""
    return min(measured, key=lambda b: (abs(math.log(rows / b)), b))


def choose(times: dict[str, float], packed_already: bool = False) -> str | None:
    """The fastest candidate of one bucket (seconds per call); a packing one only where it beats
    the best plain one by MEMORY_MARGIN, unless the shape holds a packed copy for another bucket
    anyway (its memory is spent: then simply the fastest); None for no times."""
    margin = 1.0 if packed_already else MEMORY_MARGIN
    plain = {n: t for n, t in times.items() if not BY_NAME[n].packs}
    best = min(plain, key=plain.get) if plain else None
    packed = {n: t for n, t in times.items() if BY_NAME[n].packs}
    if packed:
        p = min(packed, key=packed.get)
        if best is None or packed[p] * margin < plain[best]:
            return p
    return best


@dataclass
class Plan:
    """The chosen kernel per row count for one shape: rows use their nearest bucket's choice, and
    `kernel(rows)` is None where that bucket was not measured (the caller's static rule serves)."""

    choices: dict[int, str]  # bucket -> candidate name
    max_rows: int
    table: list[Candidate | None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        planned = buckets(self.max_rows)
        # One entry per row count up to max_rows, so a call costs one list index.
        self.table = [None] * (self.max_rows + 1)
        for rows in range(1, self.max_rows + 1):
            name = self.choices.get(nearest(rows, planned))
            self.table[rows] = None if name is None else BY_NAME[name]
        # the packing candidates chosen for some bucket: each needs its copy of the weight
        self.packings = tuple(sorted({n for n in self.choices.values() if BY_NAME[n].packs}))

    @property
    def packs(self) -> bool:
        return bool(self.packings)

    def kernel(self, rows: int) -> Candidate | None:
        return self.table[rows] if rows <= self.max_rows else self.table[-1]


# --- the cache ------------------------------------------------------------------------------


def cache_path() -> Path:
    """One JSON file per CPU model (its flags, as the kernel build keys it)."""
    cpu = hashlib.sha256(fingerprint().encode()).hexdigest()[:16]
    return cache_root() / "autotune" / f"linear-{cpu}.json"


def shape_key(n: int, k: int, dtype: torch.dtype, bias: bool, native: bool = True) -> str:
    """The cache key of one shape, with what else decides the timings (threads, torch, the C
    kernels' sources, or that they were not candidates: choices made without them must not stand
    in for a run that has them)."""
    src = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:8]
    dt = str(dtype).replace("torch.", "")
    threads = torch.get_num_threads()
    with_bias = " bias" if bias else ""
    c = f"c={src}" if native else "c=off"
    return f"{n}x{k} {dt}{with_bias} threads={threads} torch={torch.__version__} {c}"


def load_cache(path: Path) -> dict[str, dict[int, str]]:
    """shape key -> {bucket: candidate}; a missing file is empty, an unreadable one is ignored with
    a warning (and rewritten by the next save)."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") != CACHE_VERSION:
            return {}
        return {
            key: {int(b): str(c) for b, c in entry.items() if str(c) in BY_NAME}
            for key, entry in data["entries"].items()
        }
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"ignoring the unreadable autotune cache {path}: {e}", RuntimeWarning)
        return {}


def save_cache(path: Path, entries: dict[str, dict[int, str]]) -> None:
    """Merge `entries` into the file (written atomically: other processes may tune at once)."""
    merged = load_cache(path)
    for key, entry in entries.items():
        merged[key] = {**merged.get(key, {}), **entry}
    body = {"version": CACHE_VERSION, "entries": merged}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the choices still serve this process
        warnings.warn(f"could not write the autotune cache {path}: {e}", RuntimeWarning)


# --- timing -----------------------------------------------------------------------------------

Measure = Callable[[str, str, int, Callable[[int], Any]], float]  # (shape key, name, rows, run)


def wall_clock(key: str, name: str, rows: int, run: Callable[[int], Any]) -> float:
    """Seconds per call: the fastest pass of PASS_CALLS calls, run(i) taking the i-th weight in
    turn, after one warm-up call; passes until MIN_SECONDS have passed, at most MAX_CALLS calls in
    all. A pass over distinct weights, not the fastest single call: a call whose
    weight happened to sit in a cache times the kernel on cached weights, which favours the
    compute-bound kernels over the streaming ones at few rows (seen on a Xeon with AMX, where the
    fastest single call picked a 1-row kernel 2.6x slower over weights from memory). The fastest
    pass, not the mean: on a shared machine a pass that lost the CPU says nothing about the
    kernel."""
    run(0)
    best, t0 = math.inf, time.perf_counter()
    for first in range(1, MAX_CALLS + 1, PASS_CALLS):
        t = time.perf_counter()
        for i in range(first, first + PASS_CALLS):
            run(i)
        best = min(best, (time.perf_counter() - t) / PASS_CALLS)
        if time.perf_counter() - t0 >= MIN_SECONDS:
            break
    return best


@dataclass
class _Group:
    """Layers of one shape and row limit, tuned together (timed over several of their weights, so
    that the weights come from memory as they do in a forward pass)."""

    key: str
    max_rows: int
    members: list[int]  # indices into the layers
    alive: list[Candidate]
    choices: dict[int, str]
    timed: dict[int, dict[str, float]] = field(default_factory=dict)
    # packing candidate -> its copies of the timed weights, made once for all buckets (packing
    # 32 weights per bucket spent much of the budget); dropped after the group's last bucket
    copies: dict[str, list] = field(default_factory=dict)


# Distinct weights a measurement cycles over: as many as a model has of the shape, up to 32, so
# that they come from memory as in a forward pass (8 of a SmolLM2-135M shape fit in an L3 cache).
# Timed over 8, the plain call was chosen at 32 rows for the merged gate/up; timed over 32, the
# packed weights measured 1.9x faster there (AMD EPYC, avx512_bf16, 2 threads).
TIMED_LAYERS = 32


def _groups(
    layers: Sequence[Any], max_rows: Sequence[int], cache: dict, native: bool
) -> list[_Group]:
    groups: dict[tuple[str, int], _Group] = {}
    total = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    allowed = [
        c
        for c in CANDIDATES
        if (total <= PACK_MAX_BYTES or not c.packs) and (native or not c.native)
    ]
    for i, (layer, rows) in enumerate(zip(layers, max_rows)):
        w = layer.weight
        key = shape_key(*w.shape, w.dtype, layer.bias is not None, native)
        g = groups.get((key, rows))
        if g is None:
            alive = [c for c in allowed if c.applies(w)]
            names = {c.name for c in alive}
            cached = {b: c for b, c in cache.get(key, {}).items() if c in names}
            g = groups[key, rows] = _Group(key, rows, [], alive, cached)
        g.members.append(i)
    return list(groups.values())


def _time_bucket(g: _Group, layers, rows: int, measure: Measure, over: Callable[[], bool]):
    """Candidate -> seconds per call at `rows` rows: the mean of ROUNDS measurements, the
    candidates taken in turn and the order reversed each round (so a steady drift of the machine
    weighs on all alike); None when the budget ran out."""
    picked = [layers[i] for i in g.members[:TIMED_LAYERS]]
    w0 = picked[0].weight
    x = torch.randn(rows, w0.shape[1], generator=torch.Generator().manual_seed(0)).to(w0.dtype)
    runs = {}
    for cand in g.alive:
        packs = None
        if cand.packs:
            if cand.name not in g.copies:
                g.copies[cand.name] = [{cand.name: cand.pack(m.weight)} for m in picked]
            packs = g.copies[cand.name]
            if any(p[cand.name] is None for p in packs):
                continue

        def run(i: int, cand=cand, packs=packs) -> Any:
            m = picked[i % len(picked)]
            return cand.run(x, m.weight, m.bias, packs[i % len(picked)] if packs else None)

        if _agrees(run(0), x, picked[0]):
            runs[cand.name] = run
    times = dict.fromkeys(runs, 0.0)
    order = list(runs)
    # each measurement starts at the weight after the last one's: not those just read
    turn = itertools.count(0, MAX_CALLS + 1)
    for _ in range(ROUNDS):
        for name in order:
            if over():
                return None
            at = next(turn)
            seconds = measure(g.key, name, rows, lambda i, r=runs[name], at=at: r(at + i))
            times[name] += seconds / ROUNDS
        order.reverse()
    return times


def _agrees(y: Any, x: torch.Tensor, layer) -> bool:
    """A candidate's output for x through `layer` is F.linear's in float32, to the rounding of
    its dtype (relative error of the whole output). Checked before a candidate is timed: a
    library that returns a wrong result fast must not win (oneDNN's packed bf16 linear with its
    ISA capped below AVX-512 returned an empty [rows, 0] tensor; BENCHMARKS.md, run AVX2-T)."""
    b = layer.bias.float() if layer.bias is not None else None
    ref = torch.nn.functional.linear(x.float(), layer.weight.float(), b)
    if not isinstance(y, torch.Tensor) or y.shape != ref.shape:
        return False
    tol = 1e-4 if x.dtype is torch.float32 else 2e-2
    return bool((y.float() - ref).norm() <= tol * ref.norm() + 1e-6)


def _rechoose_packed(g: _Group) -> dict[int, str]:
    """Where some bucket of the group chose a packed copy, one packed copy is kept (the kind most
    buckets chose; ties: the smallest bucket's) and every timed bucket takes its fastest candidate
    among the plain ones and that copy: the copy's memory is spent, and a second kind of copy
    would add as much again. Returns the buckets whose choice changed."""
    kinds = [(rows, c) for rows, c in sorted(g.choices.items()) if BY_NAME[c].packs]
    if not kinds:
        return {}
    names = [c for _, c in kinds]
    held = max(names, key=lambda c: (names.count(c), -names.index(c)))
    changed = {}
    for rows, times in g.timed.items():
        usable = {n: t for n, t in times.items() if not BY_NAME[n].packs or n == held}
        best = choose(usable, packed_already=True)
        if best is not None and best != g.choices[rows]:
            g.choices[rows] = changed[rows] = best
    return changed


def tune(
    layers: Sequence[Any],
    max_rows: Sequence[int],
    *,
    measure: Measure = wall_clock,
    clock: Callable[[], float] = time.perf_counter,
    budget_s: float = BUDGET_S,
    path: Path | None = None,
    native: bool = True,
) -> list[Plan]:
    """A plan per layer (objects with `weight` [N, K] and `bias`, plain CPU tensors), layer i seeing
    at most max_rows[i] rows. Cached choices are reused; the rest are timed, smallest buckets first
    (decode sizes matter most), until `budget_s` is spent; new choices are saved. Not `native`:
    the C kernels are not candidates (KernelConfig.native)."""
    path = path or cache_path()
    groups = _groups(layers, max_rows, load_cache(path), native)
    deadline = clock() + budget_s
    todo = sorted(
        ((b, n) for n, g in enumerate(groups) for b in buckets(g.max_rows) if b not in g.choices),
    )
    last = {n: rows for rows, n in todo}  # each group's last bucket: its copies go after it
    fresh: dict[str, dict[int, str]] = {}
    with torch.inference_mode():
        for rows, n in todo:
            g = groups[n]
            times = _time_bucket(g, layers, rows, measure, lambda: clock() >= deadline)
            if rows == last[n]:
                g.copies.clear()
            if times is None:
                break
            best = choose(times)
            if best is None:
                continue
            g.choices[rows] = best
            g.timed[rows] = times
            fresh.setdefault(g.key, {})[rows] = best
            fastest = min(times.values())
            g.alive = [
                c
                for c in g.alive
                if not c.few_rows or times.get(c.name, 0.0) <= DROP_RATIO * fastest
            ]
    for g in groups:
        g.copies.clear()  # a group whose last bucket the budget cut off
        for rows, best in _rechoose_packed(g).items():
            fresh.setdefault(g.key, {})[rows] = best
    if fresh:
        save_cache(path, fresh)
    plans = [None] * len(layers)
    for g in groups:
        plan = Plan(dict(g.choices), g.max_rows)
        for i in g.members:
            plans[i] = plan
    return plans
