"""Allocated CUDA memory over time during one checkpoint load, from torch's allocator trace.

``torch.cuda.memory._record_memory_history`` logs every allocator call, ``_snapshot()`` returns
it, and the load's phases are ``torch.profiler.record_function`` ranges (the snapshot's
``external_annotations``). This module turns that into the level of ``memory_allocated()`` over
time, a short JSON series for the report's figures::

    recorder = LoadTimeline(baseline_bytes=torch.cuda.memory_allocated())
    recorder.start()
    recorder.mark(PHASE_SCAFFOLD)  # each mark closes the previous phase and opens the next
    ...
    timeline = recorder.stop()

The level is the running sum of the blocks of the trace's ``alloc``/``free_requested`` entries
over the baseline; ``consistency`` holds its differences to ``max_memory_allocated()`` and
``memory_allocated()``.

Result: ``{"unit": "bytes", "source", "device", "baseline_bytes", "duration_s", "points":
[[t_s, bytes_over_baseline], ...], "phases": [{"label", "start_s", "end_s"}],
"peak_bytes_over_baseline", "peak_t_s", "end_bytes_over_baseline", "dropped_events",
"phase_clock", "consistency", "points_before_downsampling", "max_points", "rounding"}``; the
points are a step function of at most ``max_points`` (:func:`downsample`). ``rounding``
(:func:`allocator_rounding`) is what the allocator's own records say of the blocks the load
allocated and still holds at its end: requested bytes against block bytes, by phase and by size.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any, Final, TypedDict

SOURCE_HISTORY: Final = "cuda_memory_history"

DEFAULT_MAX_POINTS: Final = 1500
DEFAULT_MAX_ENTRIES: Final = 1_000_000
BLOCK_ROUNDING: Final = 512
#: Large-pool requests above this take blocks that are split only when more than this remains.
SMALL_SIZE: Final = 1 << 20
ALLOCATED_SIGN: Final[Mapping[str, int]] = {"alloc": 1, "free_requested": -1}
SKIPPED_ACTIONS: Final = ("free_completed", "segment_free", "segment_map", "segment_unmap")

PHASE_SCAFFOLD: Final = "pass 1: sharded state dict (optimizer scaffold)"
PHASE_READ: Final = "checkpoint read (dist_checkpointing.load)"
PHASE_MODEL: Final = "model load_state_dict"
PHASE_PAYLOAD: Final = "pass 2: optimizer load_state_dict (payload)"
LOAD_PHASES: Final = (PHASE_SCAFFOLD, PHASE_READ, PHASE_MODEL, PHASE_PAYLOAD)
SHORT_PHASE_NAMES: Final[Mapping[str, str]] = {
    PHASE_SCAFFOLD: "pass 1",
    PHASE_READ: "read",
    PHASE_MODEL: "model",
    PHASE_PAYLOAD: "pass 2",
}
#: The range that spans the whole recording (start to stop).
RECORDING: Final = "resume-benchmark load"

Point = tuple[float, int]


class Phase(TypedDict):
    """One phase of the load, in seconds since the load began."""

    label: str
    start_s: float
    end_s: float


class Rounding(TypedDict):
    """The blocks a load allocated and still holds at its end, from the snapshot's segments."""

    blocks: int
    requested_bytes: int
    block_bytes: int
    #: Block bytes over requested bytes: the allocator's rounding, counted as allocated.
    rounding_bytes: int
    #: Per phase label: ``[blocks, requested_bytes, block_bytes]``.
    phases: dict[str, list[int]]
    #: The largest roundings: ``[requested_bytes, block_bytes, count, phase]``, at most 12.
    largest: list[list[Any]]


class Timeline(TypedDict):
    """The recorded timeline of one load (see the module docstring)."""

    unit: str
    source: str
    device: int
    baseline_bytes: int
    duration_s: float
    points: list[list[float]]
    phases: list[Phase]
    peak_bytes_over_baseline: int
    peak_t_s: float
    end_bytes_over_baseline: int
    dropped_events: bool
    phase_clock: str
    consistency: dict[str, int]
    points_before_downsampling: int
    max_points: int
    rounding: Rounding


def block_bytes(requested: int) -> int:
    """The block the allocator hands out for ``requested`` bytes (rounded up to 512 B)."""
    return max(BLOCK_ROUNDING, -(-requested // BLOCK_ROUNDING) * BLOCK_ROUNDING)


def allocation_levels(trace: Iterable[Mapping[str, Any]]) -> list[tuple[int, int]]:
    """``(time_us, level)`` after every call that changes ``memory_allocated()``, from 0 at start.

    Args:
        trace: one device's entries of ``torch.cuda.memory._snapshot()["device_traces"]``.
    """
    held: dict[int, int] = {}
    segment: tuple[int, int] | None = None
    level, levels = 0, []
    for entry in trace:
        action = entry["action"]
        if action == "segment_alloc":
            segment = (int(entry["addr"]), int(entry["size"]))
            continue
        sign = ALLOCATED_SIGN.get(action)
        if sign is None:
            continue
        address, size = int(entry["addr"]), block_bytes(int(entry["size"]))
        if sign > 0:
            if (
                segment
                and segment[0] == address
                and size > SMALL_SIZE
                and segment[1] - size <= SMALL_SIZE
            ):
                size = segment[1]  # the block is the whole new segment, unsplit
            held[address] = size
        else:
            size = held.pop(address, size)
        segment = None
        level += sign * size
        levels.append((int(entry["time_us"]), level))
    return levels


def allocator_rounding(
    snapshot: Mapping[str, Any], device: int, phases: Sequence[tuple[str, int]]
) -> Rounding:
    """What the blocks allocated in the trace and active in the snapshot's segments hold.

    Args:
        snapshot: ``torch.cuda.memory._snapshot()`` at the end of the load (``segments``' blocks
            carry ``size`` and ``requested_size``).
        device: the CUDA device index.
        phases: ``(label, start time_us)`` in time order; a block belongs to the last phase that
            began at or before its allocation.
    """
    allocated_at: dict[int, int] = {}
    for entry in snapshot["device_traces"][device]:
        if entry["action"] == "alloc":
            allocated_at[int(entry["addr"])] = int(entry["time_us"])
    sizes: dict[tuple[int, int, str], int] = {}
    by_phase: dict[str, list[int]] = {}
    for segment in snapshot.get("segments") or []:
        if segment.get("device", device) != device:
            continue
        address = int(segment["address"])
        for block in segment["blocks"]:
            start, address = address, address + int(block["size"])
            if block["state"] != "active_allocated" or start not in allocated_at:
                continue
            label = next(
                (name for name, t in reversed(phases) if t <= allocated_at[start]), "before"
            )
            key = (int(block.get("requested_size", block["size"])), int(block["size"]), label)
            sizes[key] = sizes.get(key, 0) + 1
            totals = by_phase.setdefault(label, [0, 0, 0])
            totals[0] += 1
            totals[1] += key[0]
            totals[2] += key[1]
    requested = sum(r * n for (r, _, _), n in sizes.items())
    held = sum(b * n for (_, b, _), n in sizes.items())
    largest = sorted(sizes.items(), key=lambda item: (item[0][0] - item[0][1]) * item[1])[:12]
    return {
        "blocks": sum(sizes.values()),
        "requested_bytes": requested,
        "block_bytes": held,
        "rounding_bytes": held - requested,
        "phases": by_phase,
        "largest": [[r, b, n, label] for (r, b, label), n in largest if b > r],
    }


def annotation_times(snapshot: Mapping[str, Any], device: int) -> dict[str, list[int]]:
    """``time_us`` of every ``record_function`` range start on ``device``, by name."""
    starts: dict[str, list[int]] = {}
    for note in snapshot.get("external_annotations") or []:
        if note.get("device", device) == device and note.get("stage") == "START":
            starts.setdefault(str(note.get("name")), []).append(int(note["time_us"]))
    return starts


def downsample(points: Sequence[Point], max_points: int = DEFAULT_MAX_POINTS) -> list[Point]:
    """~``max_points`` of a step function: per time bucket its min, max and last, and the peak."""
    if len(points) <= max_points:
        return list(points)
    buckets = max(1, max_points // 3)
    start, span = points[0][0], (points[-1][0] - points[0][0]) or 1.0
    chosen: dict[int, None] = {0: None, len(points) - 1: None}
    chosen[max(range(len(points)), key=lambda i: (points[i][1], -i))] = None
    groups: dict[int, list[int]] = {}
    for index, (t, _) in enumerate(points):
        groups.setdefault(min(buckets - 1, int((t - start) / span * buckets)), []).append(index)
    for members in groups.values():
        chosen.update(
            dict.fromkeys(
                (members[-1], *(f(members, key=lambda i: points[i][1]) for f in (min, max)))
            )
        )
    return [points[i] for i in sorted(chosen)]


def timeline_from_snapshot(
    snapshot: Mapping[str, Any],
    device: int,
    marks: Sequence[tuple[str, int]],
    *,
    baseline_bytes: int,
    stopped_us: int,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    max_points: int = DEFAULT_MAX_POINTS,
    allocated_peak: int | None = None,
    allocated_end: int | None = None,
) -> Timeline:
    """The timeline of the module docstring from a snapshot.

    Args:
        snapshot: ``torch.cuda.memory._snapshot()`` taken at the end of the load.
        device: the CUDA device index.
        marks: ``(label, wall-clock µs)`` of the recording start (:data:`RECORDING`) and each
            phase; a ``record_function`` start in the snapshot wins over the wall clock.
        baseline_bytes: ``memory_allocated()`` when recording began.
        stopped_us: wall-clock µs at stop.
        max_entries: the trace's ring size (a full ring has dropped older entries).
        max_points: points kept.
        allocated_peak: ``max_memory_allocated()`` at stop (after a reset at start).
        allocated_end: ``memory_allocated()`` at stop.
    """
    trace = snapshot["device_traces"][device]
    annotated = annotation_times(snapshot, device)
    times = [(label, (annotated.get(label) or [wall])[-1]) for label, wall in marks]
    start_us = times[0][1] if times else (int(trace[0]["time_us"]) if trace else 0)
    levels = allocation_levels(trace)
    dropped = len(trace) >= max_entries
    shift = 0
    if dropped and levels and allocated_end is not None:
        shift = allocated_end - baseline_bytes - levels[-1][1]
    points: list[Point] = [(0.0, shift if dropped else 0)]
    points += [(max(0.0, (t - start_us) / 1e6), level + shift) for t, level in levels]
    peak_index = max(range(len(points)), key=lambda i: (points[i][1], -i))
    duration = max(points[-1][0], (stopped_us - start_us) / 1e6)
    labels = [(label, (t - start_us) / 1e6) for label, t in times[1:]]
    ends = [begin for _, begin in labels[1:]] + [duration]
    phases = [
        Phase(label=label, start_s=begin, end_s=end) for (label, begin), end in zip(labels, ends)
    ]
    peak, end = points[peak_index][1], points[-1][1]
    consistency = {}
    if allocated_peak is not None:
        consistency["peak_difference_bytes"] = peak - (allocated_peak - baseline_bytes)
    if allocated_end is not None:
        consistency["end_difference_bytes"] = end - (allocated_end - baseline_bytes)
    return {
        "unit": "bytes",
        "source": SOURCE_HISTORY,
        "device": device,
        "baseline_bytes": baseline_bytes,
        "duration_s": duration,
        "points": [list(p) for p in downsample(points, max_points)],
        "phases": phases,
        "peak_bytes_over_baseline": peak,
        "peak_t_s": points[peak_index][0],
        "end_bytes_over_baseline": end,
        "dropped_events": dropped,
        "phase_clock": (
            "record_function" if any(l in annotated for l, _ in marks[1:]) else "wall clock"
        ),
        "consistency": consistency,
        "points_before_downsampling": len(points),
        "max_points": max_points,
        "rounding": allocator_rounding(snapshot, device, times),
    }


class LoadTimeline:
    """Records the allocator trace of one load with torch's memory history (CUDA only)."""

    def __init__(self, baseline_bytes: int, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.baseline_bytes = baseline_bytes
        self.max_entries = max_entries
        self._marks: list[tuple[str, int]] = []
        self._range = ExitStack()

    def _open(self, label: str) -> None:
        import torch

        self._range.close()
        self._range = ExitStack()
        self._range.enter_context(torch.profiler.record_function(label))
        self._marks.append((label, time.time_ns() // 1000))

    def start(self) -> None:
        """Start torch's memory history (cleared; no stacks) and the recording range."""
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device, so no allocator trace to record")
        options: dict[str, Any] = {"max_entries": self.max_entries, "context": None}
        try:
            record = torch.cuda.memory._record_memory_history
            record("all", clear_history=True, skip_actions=list(SKIPPED_ACTIONS), **options)
        except TypeError:  # a torch without skip_actions: the actions are ignored when read
            record("all", clear_history=True, **options)
        self._open(RECORDING)

    def mark(self, label: str) -> None:
        """Close the current phase and open ``label``."""
        self._open(label)

    def stop(self) -> Timeline:
        """Stop recording; the timeline of the module docstring."""
        import torch

        self._range.close()
        torch.cuda.synchronize()
        stopped = time.time_ns() // 1000
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        return timeline_from_snapshot(
            snapshot,
            torch.cuda.current_device(),
            self._marks,
            baseline_bytes=self.baseline_bytes,
            stopped_us=stopped,
            max_entries=self.max_entries,
            allocated_peak=torch.cuda.max_memory_allocated(),
            allocated_end=torch.cuda.memory_allocated(),
        )


def started_timeline(baseline_bytes: int) -> LoadTimeline | dict[str, str]:
    """A started :class:`LoadTimeline`, or the error record why none could start (never
    raises: the timeline must never fail the load it watches)."""
    try:
        recorder = LoadTimeline(baseline_bytes)
        recorder.start()
        return recorder
    except Exception as error:  # noqa: BLE001 - recorded instead
        return {"error": f"{type(error).__name__}: {error}"}


def finished_timeline(recorder: LoadTimeline | dict[str, str]) -> Timeline | dict[str, str]:
    """The timeline of a :func:`started_timeline` recorder, or an error record (never raises)."""
    if not isinstance(recorder, LoadTimeline):
        return recorder
    try:
        return recorder.stop()
    except Exception as error:  # noqa: BLE001 - recorded instead
        return {"error": f"{type(error).__name__}: {error}"}


def timeline_problems(timeline: Any) -> list[str]:
    """What is wrong with ``timeline`` as a result of this module (empty: usable)."""
    if not isinstance(timeline, Mapping):
        return ["not a JSON object"]
    problems = [] if timeline.get("unit") == "bytes" else ["unit is not 'bytes'"]
    if timeline.get("source") != SOURCE_HISTORY:
        problems.append(f"unknown source {timeline.get('source')!r}")
    points = timeline.get("points")
    if not isinstance(points, list) or not points:
        problems.append("no points")
    elif not all(isinstance(p, list) and len(p) == 2 for p in points):
        problems.append("malformed point")
    elif any(a[0] > b[0] for a, b in zip(points, points[1:])):
        problems.append("points not in time order")
    if any(not {"label", "start_s", "end_s"} <= set(p) for p in timeline.get("phases") or []):
        problems.append("malformed phase")
    for key in ("peak_bytes_over_baseline", "peak_t_s", "baseline_bytes"):
        if not isinstance(timeline.get(key), (int, float)):
            problems.append(f"{key} missing")
    return problems


def iter_levels(timeline: Mapping[str, Any]) -> Iterable[Point]:
    """The points of ``timeline`` as ``(seconds, bytes)`` tuples."""
    for t, value in timeline["points"]:
        yield float(t), int(value)


def phase_levels(timeline: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    """Per phase of the load: its label, the highest level within it and the level at its end,
    in bytes over the pre-load baseline (a phase without a point holds the level before it)."""
    points = list(iter_levels(timeline))
    levels = []
    for phase in timeline["phases"]:
        before = [value for t, value in points if t < phase["start_s"]]
        inside = [value for t, value in points if phase["start_s"] <= t <= phase["end_s"]]
        start = before[-1] if before else 0
        levels.append((phase["label"], max([start, *inside]), inside[-1] if inside else start))
    return levels
