"""Allocated CUDA memory over time during one checkpoint load, with the load's phases marked.

Used in the resume worker around the load::

    recorder = start_recorder(baseline_bytes=torch.cuda.memory_allocated())  # or
    recorder = MemoryTimelineRecorder(baseline_bytes=...); recorder.start()
    recorder.mark(PHASE_SCAFFOLD)   # each mark opens a named phase and closes the previous one
    ...
    timeline = recorder.stop()      # JSON-ready dict (see "Result" below)

torch is imported lazily inside the CUDA backends only, so this module imports (and everything
but those two thin backends is tested) without CUDA. It never imports matplotlib: figures are
drawn elsewhere (:mod:`.figures`) from the JSON.

Source ``cuda_memory_history`` (:class:`MemoryTimelineRecorder`)
-----------------------------------------------------------------

``torch.cuda.memory._record_memory_history(context=None)`` makes the caching allocator append a
trace entry for every call (no stack capture), kept in a ring buffer of ``max_entries``;
``torch.cuda.memory._snapshot()["device_traces"][device]`` returns it oldest first. What the
allocator does for each action (``c10/cuda/CUDACachingAllocator.cpp``):

* ``alloc``: ``allocated_bytes`` (what ``memory_allocated()`` returns) grows by the *block*
  size; the entry's ``size`` is the *requested* size.
* ``free_requested``: ``allocated_bytes`` shrinks by the block size at once (the entry carries
  the block's requested size), even when the block is still in use on another stream.
* ``free_completed`` (the block becomes reusable after such a cross-stream use),
  ``segment_alloc``/``segment_free``/``segment_map``/``segment_unmap`` (reserved memory),
  ``snapshot``, ``oom``, ``annotate``: no change to ``allocated_bytes``. Except
  ``segment_alloc``, they are not recorded (``skip_actions``) where torch supports skipping, and
  ignored otherwise.

The timeline is the running sum of +/- each allocation's block size, relative to the caller's
baseline (:class:`BlockSizes`): the requested size rounded up to 512 B (the allocator's block
rounding without ``roundup_power2_divisions``), or the whole new segment where the trace shows
that the allocator did not split it (a ``segment_alloc`` directly before a large ``alloc`` at
its address, at most 1 MiB over the rounded request; e.g. a 15.3 MiB tensor in a new 16 MiB
segment counts 16 MiB). That matches ``allocated_bytes`` except where the allocator reuses a
cached large-pool block at most 1 MiB larger than needed without splitting it: the trace does
not show that slack.
Two checks are recorded, not assumed: the reconstructed peak against
``max_memory_allocated() - baseline`` and the reconstructed end level against
``memory_allocated() - baseline`` at :meth:`~MemoryTimelineRecorder.stop`.

``time_us`` is the time of the call, read from the CPU's cycle counter and converted, when the
snapshot is taken, to microseconds since the Unix epoch by linear interpolation against
``system_clock`` (``c10::ApproximateClockToUnixTimeConverter``); the same wall clock as Python's
``time.time_ns()``, but only approximately (interpolation since the allocator started; NTP
adjustments in between). Phases are therefore *not* placed by Python timestamps: each boundary
(start, every :meth:`~MemoryTimelineRecorder.mark`, stop) allocates and frees a 1-byte tensor,
tagged through ``torch.cuda.memory._set_memory_metadata`` where available, and the boundary is
that allocation's position and ``time_us`` in the trace itself -- one clock for events and
phases. (A marker briefly holds one 512-byte block: negligible next to the load, and recorded
like every other allocation.) A marker missing from the trace (ring buffer overflow) falls back
to its Python ``time.time_ns()``, shifted by the median trace-minus-Python offset of the markers
that were found; ``clock_check`` reports those offsets.

Ring-buffer overflow: with ``max_entries`` entries in the trace, older ones may have been
overwritten (the trace is cleared when recording starts). ``dropped_events`` is then true and
the levels are anchored at the end (``memory_allocated()`` at stop) instead of at the baseline;
the timeline starts at the oldest retained entry. Entries of other devices (another device's
trace) are counted, never mixed in.

Source ``sampled`` (:class:`SampledMemoryTimelineRecorder`)
-----------------------------------------------------------

The fallback where memory history is unavailable (another allocator backend, a torch without
it): a background thread reads ``memory_stats(device)`` about every millisecond (in practice as
often as the GIL lets it). Phases use the same clock (``time.perf_counter_ns``). A rise of
``allocated_bytes.all.peak`` between two samples adds a point with that peak between them, so
the global peak of the load is on the curve even when no sample caught it (its time is then
known to one sampling interval).

Result
------

``{"unit": "bytes", "source", "device", "baseline_bytes", "duration_s", "points": [[t_s,
bytes_over_baseline], ...], "phases": [{"label", "start_s", "end_s"}], "peak_bytes_over_baseline",
"peak_t_s", "end_bytes_over_baseline", "dropped_events", "anchored_at", "starts_at_s", "events",
"consistency", "clock_check", "points_before_downsampling", "max_points"}``: times in seconds
since the load began, levels in bytes over the baseline (negative when the load frees memory
that was allocated before it). The points are a step function (each holds until the next) and
at most ``max_points`` long: per time bucket the minimum, the maximum and the last level are
kept, and the exact global peak always.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

SOURCE_HISTORY: Final = "cuda_memory_history"
SOURCE_SAMPLED: Final = "sampled"

#: Points kept per resume after downsampling.
DEFAULT_MAX_POINTS: Final = 1500
#: Ring-buffer size of the allocator trace (entries, each ~100 B in C++ without stacks).
DEFAULT_MAX_ENTRIES: Final = 1_000_000
#: Sampling interval of the fallback recorder.
DEFAULT_SAMPLE_INTERVAL_S: Final = 0.001

#: The caching allocator rounds every request up to a multiple of this (``kMinBlockSize``).
BLOCK_ROUNDING: Final = 512

#: Trace actions that change ``memory_allocated()``, with their sign.
ALLOCATED_SIGN: Final[Mapping[str, int]] = {"alloc": 1, "free_requested": -1}

#: Requests above this go to the large pool, whose blocks are split only when more than this
#: would remain (``kSmallSize`` of the caching allocator).
SMALL_SIZE: Final = 1 << 20

#: Trace actions that do not change ``memory_allocated()``, not recorded where torch can skip
#: them (``segment_alloc`` is kept: it tells the size of a block taken whole from a new segment).
SKIPPED_ACTIONS: Final[tuple[str, ...]] = (
    "free_completed",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
)

#: ``user_metadata`` of the marker allocations (followed by the boundary's number).
MARKER_TAG_PREFIX: Final = "resume-benchmark-timeline marker "

#: Phases of :func:`~benchmarks.resume_benchmark.checkpoint.load_checkpoint`, in order.
PHASE_SCAFFOLD: Final = "pass 1: sharded state dict (optimizer scaffold)"
PHASE_READ: Final = "checkpoint read (dist_checkpointing.load)"
PHASE_MODEL: Final = "model load_state_dict"
PHASE_PAYLOAD: Final = "pass 2: optimizer load_state_dict (payload)"
LOAD_PHASES: Final[tuple[str, ...]] = (PHASE_SCAFFOLD, PHASE_READ, PHASE_MODEL, PHASE_PAYLOAD)

#: Short names the figures print inside the phase bars.
SHORT_PHASE_NAMES: Final[Mapping[str, str]] = {
    PHASE_SCAFFOLD: "pass 1",
    PHASE_READ: "read",
    PHASE_MODEL: "model",
    PHASE_PAYLOAD: "pass 2",
}

SIZE_MODEL_NOTE: Final = (
    "trace sizes rounded up to 512 B, whole new segments where the trace shows the allocator "
    "did not split one; cached large blocks reused unsplit (up to 1 MiB more each) are not "
    "visible in the trace"
)

SAMPLED_MODEL_NOTE: Final = (
    "memory_allocated() read by a thread: exact at each sample, changes between samples missed "
    "except rises of the peak statistic"
)

#: One point of a timeline: seconds since the load began, bytes over the baseline.
Point = tuple[float, int]


class TimelineUnavailable(RuntimeError):
    """The requested recorder cannot run here (no CUDA, no memory history, not started)."""


def block_bytes(requested: int) -> int:
    """The allocator's block size for a request of ``requested`` bytes (512-byte rounding)."""
    if requested <= 0:
        return 0
    return -(-requested // BLOCK_ROUNDING) * BLOCK_ROUNDING


def allocated_delta(entry: Mapping[str, Any]) -> int:
    """How one trace entry changes ``memory_allocated()`` by its own size alone (0 for actions
    that do not); :class:`BlockSizes` also knows blocks taken whole from a new segment."""
    sign = ALLOCATED_SIGN.get(str(entry.get("action")), 0)
    if sign == 0:
        return 0
    return sign * block_bytes(int(entry.get("size", 0)))


class BlockSizes:
    """Block sizes of the allocations in a trace, as ``memory_allocated()`` counts them.

    A request is rounded up to 512 B, except where the trace shows the allocator took the
    block whole: an ``alloc`` of a large-pool request (over 1 MiB) at the start of the segment
    that the immediately preceding ``segment_alloc`` created, when at most 1 MiB of that segment
    would remain (the allocator splits large blocks only above that). A ``free_requested``
    removes what its ``alloc`` added when the trace has that ``alloc``.
    """

    def __init__(self) -> None:
        self._live: dict[int, int] = {}
        self._new_segment: tuple[int, int] | None = None
        #: Allocations whose block is a whole new segment (more than the rounded request).
        self.whole_segments = 0

    def delta(self, entry: Mapping[str, Any]) -> int:
        """The change of ``memory_allocated()`` by ``entry`` (call for every entry, in order)."""
        action = entry.get("action")
        segment, self._new_segment = self._new_segment, None
        if action == "segment_alloc":
            self._new_segment = (int(entry.get("addr", -1)), int(entry.get("size", 0)))
            return 0
        if action == "alloc":
            address, requested = int(entry.get("addr", -1)), int(entry.get("size", 0))
            block = block_bytes(requested)
            if (
                segment is not None
                and segment[0] == address
                and requested > SMALL_SIZE
                and block < segment[1] <= block + SMALL_SIZE
            ):
                block = segment[1]
                self.whole_segments += 1
            self._live[address] = block
            return block
        if action == "free_requested":
            address = int(entry.get("addr", -1))
            known = self._live.pop(address, None)
            return -(known if known is not None else block_bytes(int(entry.get("size", 0))))
        return 0


# --------------------------------------------------------------------------------------------
# Phase boundaries
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Boundary:
    """One phase boundary as the recorder saw it.

    ``label``: the phase it opens (``None``: it only closes the running one -- the start, the
    stop and :meth:`~MemoryTimelineRecorder.end_phase`). ``clock_ns``: the recorder's clock.
    ``tag``/``address``: the marker allocation of a history recorder (``None`` otherwise).
    """

    label: str | None
    clock_ns: int
    tag: str | None = None
    address: int | None = None


def phase_spans(
    boundaries: Sequence[tuple[str | None, float]], end_s: float
) -> list[dict[str, Any]]:
    """``[{"label", "start_s", "end_s"}]`` from consecutive ``(label, time)`` boundaries.

    Each labelled boundary opens a phase that the next boundary closes; the last one is closed at
    ``end_s``. Times are clamped to ``[0, end_s]`` and made non-decreasing.
    """
    spans: list[dict[str, Any]] = []
    clamped: list[tuple[str | None, float]] = []
    previous = 0.0
    for label, at in boundaries:
        at = min(max(at, previous, 0.0), max(end_s, 0.0))
        clamped.append((label, at))
        previous = at
    for index, (label, at) in enumerate(clamped):
        if label is None:
            continue
        until = clamped[index + 1][1] if index + 1 < len(clamped) else max(end_s, at)
        spans.append({"label": label, "start_s": _seconds(at), "end_s": _seconds(until)})
    return spans


# --------------------------------------------------------------------------------------------
# Downsampling
# --------------------------------------------------------------------------------------------


def downsample(points: Sequence[Point], max_points: int = DEFAULT_MAX_POINTS) -> list[Point]:
    """At most ``max_points`` of ``points`` (a step function in time order), its shape kept.

    The time range is cut into equal buckets; each keeps its first maximum, its first minimum
    and its last point (the level the step holds into the next bucket), in time order. The first
    and the last point and the first global maximum are always kept.
    """
    if max_points < 8:
        raise ValueError("max_points must be at least 8")
    if len(points) <= max_points:
        return list(points)
    first_t, last_t = points[0][0], points[-1][0]
    buckets = (max_points - 3) // 3
    span = last_t - first_t

    def bucket_of(index: int) -> int:
        if span > 0:
            return min(buckets - 1, int((points[index][0] - first_t) / span * buckets))
        return min(buckets - 1, index * buckets // len(points))

    keep = {0, len(points) - 1, _first_max(points)}
    start = 0
    while start < len(points):
        bucket = bucket_of(start)
        stop = start
        high = low = start
        while stop < len(points) and bucket_of(stop) == bucket:
            if points[stop][1] > points[high][1]:
                high = stop
            if points[stop][1] < points[low][1]:
                low = stop
            stop += 1
        keep.update((high, low, stop - 1))
        start = stop
    return [points[i] for i in sorted(keep)]


def _first_max(points: Sequence[Point]) -> int:
    best = 0
    for index, (_, value) in enumerate(points):
        if value > points[best][1]:
            best = index
    return best


def bucket_extremes(points: Sequence[Point], buckets: int) -> list[tuple[int, int]]:
    """``(min, max)`` level per non-empty time bucket (``buckets`` equal ones): test helper and
    a cheap summary of a timeline."""
    if not points:
        return []
    first_t, last_t = points[0][0], points[-1][0]
    span = last_t - first_t
    found: dict[int, tuple[int, int]] = {}
    for index, (t, value) in enumerate(points):
        if span > 0:
            bucket = min(buckets - 1, int((t - first_t) / span * buckets))
        else:
            bucket = min(buckets - 1, index * buckets // len(points))
        low, high = found.get(bucket, (value, value))
        found[bucket] = (min(low, value), max(high, value))
    return [found[b] for b in sorted(found)]


# --------------------------------------------------------------------------------------------
# Allocator trace -> timeline
# --------------------------------------------------------------------------------------------


def device_trace(snapshot: Mapping[str, Any], device: int) -> tuple[list[Mapping[str, Any]], int]:
    """The trace entries of ``device`` and the number of entries on the other devices."""
    traces = snapshot.get("device_traces")
    if not isinstance(traces, Sequence):
        raise ValueError("snapshot without 'device_traces' (was memory history recorded?)")
    mine: list[Mapping[str, Any]] = []
    others = 0
    for index, trace in enumerate(traces):
        if index == device:
            mine = list(trace)
        else:
            others += len(trace)
    return mine, others


def find_markers(
    entries: Sequence[Mapping[str, Any]], boundaries: Sequence[Boundary]
) -> list[int | None]:
    """Index in ``entries`` of each boundary's marker allocation (``None``: not in the trace).

    Where the trace carries marker tags (``user_metadata``), a marker is the ``alloc`` entry
    with the boundary's tag. Otherwise (a torch without memory metadata) it is the first
    1-byte ``alloc`` at the boundary's address after the previous marker found.
    """
    by_tag: dict[str, int] = {}
    for position, entry in enumerate(entries):
        meta = entry.get("user_metadata")
        if (
            entry.get("action") == "alloc"
            and isinstance(meta, str)
            and meta.startswith(MARKER_TAG_PREFIX)
        ):
            by_tag.setdefault(meta, position)
    found: list[int | None] = []
    after = -1
    for boundary in boundaries:
        index: int | None = None
        if by_tag:
            candidate = by_tag.get(boundary.tag or "")
            index = candidate if candidate is not None and candidate > after else None
        elif boundary.address is not None:
            index = _first_marker_at(entries, boundary.address, after + 1)
        found.append(index)
        if index is not None:
            after = index
    return found


def _first_marker_at(entries: Sequence[Mapping[str, Any]], address: int, begin: int) -> int | None:
    for position in range(begin, len(entries)):
        entry = entries[position]
        if (
            entry.get("action") == "alloc"
            and entry.get("addr") == address
            and int(entry.get("size", -1)) == 1
        ):
            return position
    return None


def timeline_from_snapshot(
    snapshot: Mapping[str, Any],
    *,
    device: int,
    boundaries: Sequence[Boundary],
    baseline_bytes: int,
    allocated_at_stop_bytes: int | None = None,
    max_allocated_bytes: int | None = None,
    max_allocated_at_start_bytes: int | None = None,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    max_points: int = DEFAULT_MAX_POINTS,
) -> dict[str, Any]:
    """The timeline of one recording from ``torch.cuda.memory._snapshot()``'s allocator trace.

    ``boundaries``: the start, every mark, the stop (in order; clocks in epoch nanoseconds).
    ``allocated_at_stop_bytes``/``max_allocated_bytes``: ``memory_allocated()`` and
    ``max_memory_allocated()`` at stop, for the consistency checks and for anchoring the levels
    at the end when the ring buffer overflowed. ``max_allocated_at_start_bytes``: the peak
    statistic when recording started (it must equal the baseline for the peak check to apply:
    ``reset_peak_memory_stats()`` before the baseline).
    """
    if len(boundaries) < 2 or boundaries[0].label is not None or boundaries[-1].label is not None:
        raise ValueError("boundaries must start and end with an unlabelled start/stop boundary")
    entries, other_devices = device_trace(snapshot, device)
    if any("time_us" not in entry for entry in entries):
        raise ValueError("allocator trace entries without 'time_us' (a torch older than 2.1?)")
    dropped = len(entries) >= max_entries
    markers = find_markers(entries, boundaries)
    offsets = [  # integer nanoseconds first: epoch nanoseconds do not fit a double exactly
        (int(entries[i]["time_us"]) * 1000 - b.clock_ns) / 1000.0
        for i, b in zip(markers, boundaries, strict=True)
        if i is not None
    ]
    offset_us = statistics.median(offsets) if offsets else 0.0

    def boundary_us(position: int) -> float:
        index = markers[position]
        if index is not None:
            return float(entries[index]["time_us"])
        return boundaries[position].clock_ns / 1000.0 + offset_us

    origin_us = boundary_us(0)
    stop_s = max(0.0, (boundary_us(len(boundaries) - 1) - origin_us) / 1e6)

    counts = {"alloc": 0, "free_requested": 0, "ignored": 0, "oom": 0}
    steps: list[tuple[float, int]] = []  # (time since origin, delta), in trace order
    previous_t = 0.0
    blocks = BlockSizes()
    for entry in entries:
        action = str(entry.get("action"))
        delta = blocks.delta(entry)
        if action in ALLOCATED_SIGN:
            counts[action] += 1
        elif action == "oom":
            counts["oom"] += 1
        else:
            counts["ignored"] += 1
        if action not in ALLOCATED_SIGN:
            continue
        # Trace order is allocation order; clamp into the recording (the stop marker's own free
        # comes after the stop boundary) and keep the times non-decreasing.
        t = min(max((float(entry["time_us"]) - origin_us) / 1e6, previous_t), stop_s)
        previous_t = t
        steps.append((t, delta))

    total = sum(delta for _, delta in steps)
    anchored_at = "start"
    start_level = 0
    if dropped and allocated_at_stop_bytes is not None:
        anchored_at = "end"
        start_level = allocated_at_stop_bytes - baseline_bytes - total
    points: list[Point] = []
    starts_at = 0.0 if not dropped or not steps else steps[0][0]
    points.append((starts_at, start_level))
    level = start_level
    for t, delta in steps:
        level += delta
        points.append((t, level))
    points.append((max(stop_s, points[-1][0]), level))

    spans = phase_spans(
        [(b.label, (boundary_us(i) - origin_us) / 1e6) for i, b in enumerate(boundaries)],
        stop_s,
    )
    found = [i for i in markers if i is not None]
    clock_check = {
        "phase_times_from": "trace markers" if len(found) == len(boundaries) else (
            "trace markers and the Python clock" if found else "the Python clock"
        ),
        "markers_found": len(found),
        "markers_expected": len(boundaries),
        "trace_minus_python_us": _range(offsets),
    }
    return _result(
        source=SOURCE_HISTORY,
        device=device,
        baseline_bytes=baseline_bytes,
        points=points,
        spans=spans,
        duration_s=stop_s,
        dropped=dropped,
        anchored_at=anchored_at,
        starts_at_s=starts_at,
        events={
            **counts,
            "whole_segment_blocks": blocks.whole_segments,
            "trace_entries": len(entries),
            "other_device_entries": other_devices,
            "max_entries": max_entries,
        },
        allocated_at_stop_bytes=allocated_at_stop_bytes,
        max_allocated_bytes=max_allocated_bytes,
        max_allocated_at_start_bytes=max_allocated_at_start_bytes,
        clock_check=clock_check,
        max_points=max_points,
    )


def _range(values: Sequence[float]) -> list[float] | None:
    return [round(min(values), 3), round(max(values), 3)] if values else None


def _seconds(value: float) -> float:
    return round(value, 6)


def _result(
    *,
    source: str,
    device: int,
    baseline_bytes: int,
    points: Sequence[Point],
    spans: list[dict[str, Any]],
    duration_s: float,
    dropped: bool,
    anchored_at: str,
    starts_at_s: float,
    events: dict[str, int],
    allocated_at_stop_bytes: int | None,
    max_allocated_bytes: int | None,
    max_allocated_at_start_bytes: int | None,
    clock_check: dict[str, Any],
    max_points: int,
) -> dict[str, Any]:
    """The JSON-ready timeline (common to both sources)."""
    peak_index = _first_max(points)
    peak_t, peak = points[peak_index]
    end = points[-1][1]
    over_max = None if max_allocated_bytes is None else max_allocated_bytes - baseline_bytes
    at_stop = None if allocated_at_stop_bytes is None else allocated_at_stop_bytes - baseline_bytes
    reset = None
    if max_allocated_at_start_bytes is not None:
        reset = max_allocated_at_start_bytes <= baseline_bytes
    kept = downsample(points, max_points)
    return {
        "unit": "bytes",
        "source": source,
        "device": device,
        "baseline_bytes": baseline_bytes,
        "duration_s": _seconds(duration_s),
        "points": [[_seconds(t), int(v)] for t, v in kept],
        "phases": spans,
        "peak_bytes_over_baseline": int(peak),
        "peak_t_s": _seconds(peak_t),
        "end_bytes_over_baseline": int(end),
        "dropped_events": dropped,
        "anchored_at": anchored_at,
        "starts_at_s": _seconds(starts_at_s),
        "events": events,
        "consistency": {
            "size_model": SIZE_MODEL_NOTE if source == SOURCE_HISTORY else SAMPLED_MODEL_NOTE,
            "max_memory_allocated_over_baseline": over_max,
            "peak_difference_bytes": None if over_max is None else int(peak) - over_max,
            "peak_stats_reset_before_start": reset,
            "allocated_at_stop_over_baseline": at_stop,
            "end_difference_bytes": None if at_stop is None else int(end) - at_stop,
        },
        "clock_check": clock_check,
        "points_before_downsampling": len(points),
        "max_points": max_points,
    }


# --------------------------------------------------------------------------------------------
# Samples -> timeline
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One reading of the sampling recorder: its clock, current and peak allocated bytes."""

    clock_ns: int
    allocated_bytes: int
    peak_bytes: int


def timeline_from_samples(
    samples: Sequence[Sample],
    *,
    device: int,
    boundaries: Sequence[Boundary],
    baseline_bytes: int,
    max_allocated_at_start_bytes: int | None = None,
    interval_s: float = DEFAULT_SAMPLE_INTERVAL_S,
    max_points: int = DEFAULT_MAX_POINTS,
) -> dict[str, Any]:
    """The timeline of one sampled recording (boundaries and samples on the same clock).

    Where the peak statistic rose between two samples beyond both, a point with that peak is
    inserted midway, so the load's global peak (``max_memory_allocated()``) is on the curve.
    """
    if len(boundaries) < 2 or boundaries[0].label is not None or boundaries[-1].label is not None:
        raise ValueError("boundaries must start and end with an unlabelled start/stop boundary")
    if not samples:
        raise ValueError("no samples")
    origin = boundaries[0].clock_ns
    stop_s = max(0.0, (boundaries[-1].clock_ns - origin) / 1e9)
    points: list[Point] = [(0.0, 0)]
    inserted = 0
    previous_peak = max_allocated_at_start_bytes if max_allocated_at_start_bytes is not None else 0
    previous_t = 0.0
    previous_level = 0
    for sample in samples:
        t = min(max((sample.clock_ns - origin) / 1e9, previous_t), stop_s)
        level = sample.allocated_bytes - baseline_bytes
        rose = sample.peak_bytes > previous_peak
        if rose and sample.peak_bytes - baseline_bytes > max(level, previous_level):
            points.append(((previous_t + t) / 2, sample.peak_bytes - baseline_bytes))
            inserted += 1
        previous_peak = max(previous_peak, sample.peak_bytes)
        points.append((t, level))
        previous_t, previous_level = t, level
    points.append((max(stop_s, points[-1][0]), points[-1][1]))
    last = samples[-1]
    spans = phase_spans([(b.label, (b.clock_ns - origin) / 1e9) for b in boundaries], stop_s)
    gaps = [
        (b.clock_ns - a.clock_ns) / 1e9 for a, b in zip(samples, samples[1:], strict=False)
    ]
    return _result(
        source=SOURCE_SAMPLED,
        device=device,
        baseline_bytes=baseline_bytes,
        points=points,
        spans=spans,
        duration_s=stop_s,
        dropped=False,
        anchored_at="start",
        starts_at_s=0.0,
        events={
            "samples": len(samples),
            "peak_points_inserted": inserted,
            "requested_interval_us": round(interval_s * 1e6),
            "median_interval_us": round(statistics.median(gaps) * 1e6) if gaps else 0,
            "max_interval_us": round(max(gaps) * 1e6) if gaps else 0,
        },
        allocated_at_stop_bytes=last.allocated_bytes,
        max_allocated_bytes=last.peak_bytes,
        max_allocated_at_start_bytes=max_allocated_at_start_bytes,
        clock_check={"phase_times_from": "the sampling clock (time.perf_counter_ns)"},
        max_points=max_points,
    )


# --------------------------------------------------------------------------------------------
# Recorders
# --------------------------------------------------------------------------------------------


class HistoryBackend(Protocol):
    """What :class:`MemoryTimelineRecorder` needs from CUDA (a fake one in the CPU tests)."""

    device: int

    def enable(self, max_entries: int, skip_actions: Sequence[str]) -> None:
        """Start recording the allocator trace, cleared, without stack capture."""

    def disable(self) -> None:
        """Stop recording (and drop the trace)."""

    def snapshot(self) -> Mapping[str, Any]:
        """``torch.cuda.memory._snapshot()``."""

    def place_marker(self, tag: str) -> int:
        """Allocate and free a 1-byte tensor tagged ``tag``; return its address."""

    def allocated_bytes(self) -> int:
        """``memory_allocated(device)``."""

    def max_allocated_bytes(self) -> int:
        """``max_memory_allocated(device)``."""


class StatsReader(Protocol):
    """What :class:`SampledMemoryTimelineRecorder` reads (a fake one in the CPU tests)."""

    device: int

    def read(self) -> tuple[int, int]:
        """``(memory_allocated, max_memory_allocated)`` of the device, from one stats call."""


class _Phases:
    """Boundaries of a recording: start, marks, stop; shared by both recorders."""

    def __init__(self) -> None:
        self.boundaries: list[Boundary] = []
        self.running = False
        self.stopped = False

    def check_running(self, what: str) -> None:
        if not self.running:
            state = "stopped" if self.stopped else "not started"
            raise TimelineUnavailable(f"{what}: the recorder is {state}")


class MemoryTimelineRecorder:
    """Records the allocator trace (``cuda_memory_history``) from :meth:`start` to :meth:`stop`.

    ``baseline_bytes``: ``memory_allocated()`` just before :meth:`start` (levels are relative to
    it). ``device``: the CUDA device (default: the current one). ``backend``: for tests.
    """

    def __init__(
        self,
        baseline_bytes: int,
        *,
        device: int | None = None,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_points: int = DEFAULT_MAX_POINTS,
        backend: HistoryBackend | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.baseline_bytes = int(baseline_bytes)
        self.max_entries = max_entries
        self.max_points = max_points
        self._backend = backend if backend is not None else TorchCudaHistory(device)
        self._clock_ns = clock_ns
        self._phases = _Phases()
        self._max_at_start: int | None = None

    @property
    def source(self) -> str:
        return SOURCE_HISTORY

    def start(self) -> None:
        """Clear and start the allocator trace, then place the start marker."""
        if self._phases.running or self._phases.stopped:
            raise TimelineUnavailable("start: a recorder records once")
        self._max_at_start = self._backend.max_allocated_bytes()
        self._backend.enable(self.max_entries, SKIPPED_ACTIONS)
        try:
            self._boundary(None)
        except BaseException:
            self._backend.disable()
            raise
        self._phases.running = True

    def mark(self, label: str) -> None:
        """Begin the phase ``label`` (and end the running one)."""
        if not label:
            raise ValueError("a phase needs a label")
        self._phases.check_running("mark")
        self._boundary(label)

    def end_phase(self) -> None:
        """End the running phase without beginning another."""
        self._phases.check_running("end_phase")
        self._boundary(None)

    def stop(self) -> dict[str, Any]:
        """Place the stop marker, read the trace, stop recording; return the timeline."""
        self._phases.check_running("stop")
        try:
            self._boundary(None)
            allocated = self._backend.allocated_bytes()
            peak = self._backend.max_allocated_bytes()
            snapshot = self._backend.snapshot()
        finally:
            self._phases.running = False
            self._phases.stopped = True
            self._backend.disable()
        return timeline_from_snapshot(
            snapshot,
            device=self._backend.device,
            boundaries=self._phases.boundaries,
            baseline_bytes=self.baseline_bytes,
            allocated_at_stop_bytes=allocated,
            max_allocated_bytes=peak,
            max_allocated_at_start_bytes=self._max_at_start,
            max_entries=self.max_entries,
            max_points=self.max_points,
        )

    def _boundary(self, label: str | None) -> None:
        tag = f"{MARKER_TAG_PREFIX}{len(self._phases.boundaries)}"
        clock = self._clock_ns()
        address = self._backend.place_marker(tag)
        self._phases.boundaries.append(Boundary(label, clock, tag, address))


class SampledMemoryTimelineRecorder:
    """Samples ``memory_allocated()`` in a background thread (``sampled``); same interface."""

    def __init__(
        self,
        baseline_bytes: int,
        *,
        device: int | None = None,
        interval_s: float = DEFAULT_SAMPLE_INTERVAL_S,
        max_points: int = DEFAULT_MAX_POINTS,
        reader: StatsReader | None = None,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.baseline_bytes = int(baseline_bytes)
        self.interval_s = interval_s
        self.max_points = max_points
        self._reader = reader if reader is not None else TorchCudaStats(device)
        self._clock_ns = clock_ns
        self._sleep = sleep
        self._phases = _Phases()
        self._samples: list[Sample] = []
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._max_at_start: int | None = None
        self._error: BaseException | None = None
        #: Why the history recorder was not used (set by :func:`start_recorder`).
        self.fallback_reason: str | None = None

    @property
    def source(self) -> str:
        return SOURCE_SAMPLED

    def start(self) -> None:
        """Take the first sample and start the sampling thread."""
        if self._phases.running or self._phases.stopped:
            raise TimelineUnavailable("start: a recorder records once")
        self._max_at_start = self._reader.read()[1]
        self._phases.running = True
        self._phases.boundaries.append(Boundary(None, self._clock_ns()))
        self.sample_once()
        self._thread = threading.Thread(target=self._run, name="memory-timeline", daemon=True)
        self._thread.start()

    def mark(self, label: str) -> None:
        """Begin the phase ``label`` (and end the running one)."""
        if not label:
            raise ValueError("a phase needs a label")
        self._phases.check_running("mark")
        self._phases.boundaries.append(Boundary(label, self._clock_ns()))

    def end_phase(self) -> None:
        """End the running phase without beginning another."""
        self._phases.check_running("end_phase")
        self._phases.boundaries.append(Boundary(None, self._clock_ns()))

    def sample_once(self) -> None:
        """Take one sample now (the thread's body; tests call it directly)."""
        allocated, peak = self._reader.read()
        self._samples.append(Sample(self._clock_ns(), allocated, peak))

    def stop(self) -> dict[str, Any]:
        """Stop the thread, take a last sample; return the timeline."""
        self._phases.check_running("stop")
        self._stop_event.set()
        if self._thread is not None:
            self._thread.join()
        if self._error is None:
            try:
                self.sample_once()
            except Exception as error:  # noqa: BLE001 - reported below
                self._error = error
        self._phases.boundaries.append(Boundary(None, self._clock_ns()))
        self._phases.running = False
        self._phases.stopped = True
        if self._error is not None:
            raise TimelineUnavailable(f"sampling failed: {self._error!r}") from self._error
        timeline = timeline_from_samples(
            self._samples,
            device=self._reader.device,
            boundaries=self._phases.boundaries,
            baseline_bytes=self.baseline_bytes,
            max_allocated_at_start_bytes=self._max_at_start,
            interval_s=self.interval_s,
            max_points=self.max_points,
        )
        if self.fallback_reason is not None:
            timeline["fallback_reason"] = self.fallback_reason
        return timeline

    def _run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self.sample_once()
                self._sleep(self.interval_s)
        except BaseException as error:  # noqa: BLE001 - reported by stop()
            self._error = error


Recorder = MemoryTimelineRecorder | SampledMemoryTimelineRecorder


def start_recorder(
    baseline_bytes: int,
    *,
    device: int | None = None,
    prefer: str = SOURCE_HISTORY,
    max_points: int = DEFAULT_MAX_POINTS,
) -> Recorder:
    """A started recorder: memory history where it starts, else the sampling fallback (its
    result then says why in ``fallback_reason``).

    Raises :class:`TimelineUnavailable` without CUDA.
    """
    if prefer not in (SOURCE_HISTORY, SOURCE_SAMPLED):
        raise ValueError(f"unknown timeline source {prefer!r}")
    reason = None
    if prefer == SOURCE_HISTORY:
        history = MemoryTimelineRecorder(baseline_bytes, device=device, max_points=max_points)
        try:
            history.start()
            return history
        except (RuntimeError, AttributeError, TypeError) as why:  # no history in this torch
            reason = f"memory history unavailable: {type(why).__name__}: {why}"
    sampled = SampledMemoryTimelineRecorder(baseline_bytes, device=device, max_points=max_points)
    sampled.fallback_reason = reason
    sampled.start()
    return sampled


# --------------------------------------------------------------------------------------------
# Thin torch backends (the only code here that needs CUDA)
# --------------------------------------------------------------------------------------------


def _cuda_device(device: int | None) -> int:
    import torch

    if not torch.cuda.is_available():
        raise TimelineUnavailable("no CUDA: the memory timeline needs a CUDA device")
    return int(torch.cuda.current_device() if device is None else device)


class TorchCudaHistory:
    """:class:`HistoryBackend` on the CUDA caching allocator."""

    def __init__(self, device: int | None = None) -> None:
        self.device = _cuda_device(device)

    def enable(self, max_entries: int, skip_actions: Sequence[str]) -> None:
        import torch

        backend = torch.cuda.get_allocator_backend()
        if backend != "native":
            raise TimelineUnavailable(f"memory history needs the native allocator, not {backend}")
        record = torch.cuda.memory._record_memory_history
        options: dict[str, Any] = {
            "context": None,
            "stacks": "python",
            "max_entries": max_entries,
            "clear_history": True,
        }
        try:
            record("all", skip_actions=list(skip_actions), **options)
        except (TypeError, RuntimeError):
            # a torch without skip_actions (or without one of these actions): record them all;
            # they are ignored when the trace is read
            record("all", **options)

    def disable(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(None)

    def snapshot(self) -> Mapping[str, Any]:
        import torch

        snapshot: Mapping[str, Any] = torch.cuda.memory._snapshot()
        return snapshot

    def place_marker(self, tag: str) -> int:
        import torch

        memory = torch.cuda.memory
        tagging = bool(getattr(memory, "_memory_metadata_supported", lambda: False)())
        previous = memory._get_memory_metadata() if tagging else ""
        if tagging:
            memory._set_memory_metadata(tag)
        try:
            marker = torch.empty(1, dtype=torch.uint8, device=torch.device("cuda", self.device))
            address = int(marker.data_ptr())
            del marker
        finally:
            if tagging:
                memory._set_memory_metadata(previous)
        return address

    def allocated_bytes(self) -> int:
        import torch

        return int(torch.cuda.memory_allocated(self.device))

    def max_allocated_bytes(self) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated(self.device))


class TorchCudaStats:
    """:class:`StatsReader` on ``torch.cuda.memory_stats`` (one call per sample)."""

    def __init__(self, device: int | None = None) -> None:
        self.device = _cuda_device(device)

    def read(self) -> tuple[int, int]:
        import torch

        stats = torch.cuda.memory_stats(self.device)
        return int(stats.get("allocated_bytes.all.current", 0)), int(
            stats.get("allocated_bytes.all.peak", 0)
        )


# --------------------------------------------------------------------------------------------
# Validation (used by the figures and the tests)
# --------------------------------------------------------------------------------------------


def timeline_problems(timeline: Any) -> list[str]:
    """What is wrong with ``timeline`` as a result of this module (empty: usable)."""
    if not isinstance(timeline, Mapping):
        return ["not a JSON object"]
    problems: list[str] = []
    if timeline.get("unit") != "bytes":
        problems.append("unit is not 'bytes'")
    if timeline.get("source") not in (SOURCE_HISTORY, SOURCE_SAMPLED):
        problems.append(f"unknown source {timeline.get('source')!r}")
    points = timeline.get("points")
    if not isinstance(points, list) or not points:
        problems.append("no points")
    else:
        previous = -math.inf
        for point in points:
            if (
                not isinstance(point, list)
                or len(point) != 2
                or not all(isinstance(v, (int, float)) for v in point)
            ):
                problems.append(f"malformed point {point!r}")
                break
            if point[0] < previous:
                problems.append("points not in time order")
                break
            previous = point[0]
    for phase in timeline.get("phases") or []:
        if not isinstance(phase, Mapping) or not {"label", "start_s", "end_s"} <= set(phase):
            problems.append(f"malformed phase {phase!r}")
            break
    for key in ("peak_bytes_over_baseline", "peak_t_s", "baseline_bytes"):
        if not isinstance(timeline.get(key), (int, float)):
            problems.append(f"{key} missing")
    return problems


def iter_levels(timeline: Mapping[str, Any]) -> Iterable[Point]:
    """The points of ``timeline`` as ``(seconds, bytes)`` tuples."""
    for t, value in timeline["points"]:
        yield float(t), int(value)

