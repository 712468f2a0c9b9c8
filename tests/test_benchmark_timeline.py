"""Memory timelines of the resume benchmark, on the CPU.

The allocator trace is imitated by :mod:`timeline_fakes` (entries shaped like
``torch.cuda.memory._snapshot()``'s, with the caching allocator's accounting: ``alloc`` adds
and ``free_requested`` removes the 512-byte-rounded block, the entry carries the requested
size). Covered: trace -> timeline (peak and end level against the allocator's statistics),
phase marking through marker allocations (tagged or found by address) independent of the
Python clock, actions that do not change the allocated bytes, other devices, ring-buffer
overflow, downsampling, the sampling fallback, misuse, JSON round trip, and the figures (a PNG
is written; pixels are not compared). Figure tests need matplotlib (requirements/test.txt) and
are skipped without it.
"""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from timeline_fakes import (
    FakeAllocator,
    FakeHistoryBackend,
    python_clock,
    recorded_resume,
)

from benchmarks.resume_benchmark import memory_timeline as mt
from benchmarks.resume_benchmark.memory_timeline import (
    LOAD_PHASES,
    Boundary,
    MemoryTimelineRecorder,
    SampledMemoryTimelineRecorder,
    TimelineUnavailable,
    allocated_delta,
    block_bytes,
    bucket_extremes,
    downsample,
    phase_spans,
    timeline_from_snapshot,
    timeline_problems,
)

MIB = 1 << 20

# --------------------------------------------------------------------------------------------
# Allocator accounting
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "block"),
    [(0, 0), (1, 512), (511, 512), (512, 512), (513, 1024), (MIB + 1, MIB + 512)],
)
def test_block_bytes_rounds_like_the_caching_allocator(requested: int, block: int) -> None:
    assert block_bytes(requested) == block


@pytest.mark.parametrize(
    ("action", "sign"),
    [
        ("alloc", 1),
        ("free_requested", -1),
        ("free_completed", 0),
        ("segment_alloc", 0),
        ("segment_free", 0),
        ("segment_map", 0),
        ("segment_unmap", 0),
        ("snapshot", 0),
        ("oom", 0),
        ("annotate", 0),
    ],
)
def test_only_alloc_and_free_requested_change_allocated_bytes(action: str, sign: int) -> None:
    assert allocated_delta({"action": action, "addr": 1, "size": 1000}) == sign * 1024


# --------------------------------------------------------------------------------------------
# Recorder on the fake allocator
# --------------------------------------------------------------------------------------------


def _phase_labels(timeline: dict[str, Any]) -> list[str]:
    return [p["label"] for p in timeline["phases"]]


def test_resume_timeline_matches_the_allocator_statistics() -> None:
    timeline, allocator = recorded_resume()
    baseline = timeline["baseline_bytes"]
    consistency = timeline["consistency"]
    assert consistency["max_memory_allocated_over_baseline"] == allocator.peak - baseline
    # The synthetic load holds one block with 512 B of slack at the peak (a block the
    # allocator did not split): invisible in the trace, so the curve's peak is 512 B lower.
    assert consistency["peak_difference_bytes"] == -512
    assert timeline["peak_bytes_over_baseline"] == allocator.peak - baseline - 512
    assert consistency["end_difference_bytes"] == 0
    assert timeline["end_bytes_over_baseline"] == allocator.allocated - baseline
    assert consistency["peak_stats_reset_before_start"] is True
    assert timeline["dropped_events"] is False
    assert timeline["anchored_at"] == "start"
    assert timeline["points"][0] == [0.0, 0]
    assert timeline["source"] == mt.SOURCE_HISTORY


def test_exact_without_slack() -> None:
    allocator = FakeAllocator(baseline_bytes=7 * MIB)
    allocator.reset_peak()
    recorder = MemoryTimelineRecorder(
        allocator.allocated, backend=FakeHistoryBackend(allocator), clock_ns=python_clock(allocator)
    )
    recorder.start()
    recorder.mark("one")
    a = allocator.alloc(3 * MIB + 5)
    allocator.advance(1000)
    b = allocator.alloc(100)
    allocator.advance(1000)
    allocator.free(a)
    allocator.advance(1000)
    recorder.mark("two")
    c = allocator.alloc(MIB)
    allocator.advance(1000)
    allocator.free(b)
    timeline = recorder.stop()
    del c
    assert timeline["peak_bytes_over_baseline"] == 3 * MIB + 512 + 512
    assert timeline["consistency"]["peak_difference_bytes"] == 0
    assert timeline["end_bytes_over_baseline"] == MIB
    assert timeline["consistency"]["end_difference_bytes"] == 0
    assert timeline["peak_t_s"] == pytest.approx(0.001, abs=2e-6)
    levels = [v for _, v in timeline["points"]]
    # start, the markers (+512 -512 each), a, b, free a, marker, c, free b, stop marker, end
    assert max(levels) == 3 * MIB + 1024
    assert levels[-1] == MIB


def test_blocks_taken_whole_from_a_new_segment_are_counted_whole() -> None:
    allocator = FakeAllocator()
    recorder = MemoryTimelineRecorder(
        0, backend=FakeHistoryBackend(allocator), clock_ns=python_clock(allocator)
    )
    recorder.start()
    odd = [allocator.alloc(16_043_213) for _ in range(3)]  # 15.3 MiB each in a new 16 MiB
    split = allocator.alloc(15 * MIB)  # new 16 MiB segment, 1 MiB remains: not split either
    smaller = allocator.alloc(13 * MIB)  # new 14 MiB segment, likewise
    big = allocator.alloc(5 * MIB + 3)  # new 20 MiB segment: split
    allocator.advance(10)
    allocator.free(odd[0])
    timeline = recorder.stop()
    del split, smaller, big
    assert timeline["events"]["whole_segment_blocks"] == 5
    assert timeline["peak_bytes_over_baseline"] == 5 * 16 * MIB - 2 * MIB + 5 * MIB + 512
    assert timeline["consistency"]["peak_difference_bytes"] == 0
    assert timeline["consistency"]["end_difference_bytes"] == 0


def test_phases_follow_the_marks_in_order_and_tile_the_load() -> None:
    timeline, _ = recorded_resume()
    phases = timeline["phases"]
    assert _phase_labels(timeline) == list(LOAD_PHASES)
    assert phases[0]["start_s"] > 0.0  # 50 us after the start marker
    for before, after in zip(phases, phases[1:]):
        assert before["end_s"] == after["start_s"]
        assert before["start_s"] < before["end_s"]
    assert phases[-1]["end_s"] == pytest.approx(timeline["duration_s"], abs=1e-6)
    check = timeline["clock_check"]
    assert check["markers_found"] == check["markers_expected"] == 6
    assert timeline["clock_check"]["phase_times_from"] == "trace markers"


def test_phases_come_from_the_trace_not_the_python_clock() -> None:
    aligned, _ = recorded_resume(skew_us=0)
    skewed, _ = recorded_resume(skew_us=250_000)  # Python's clock 0.25 s ahead of the trace's
    assert skewed["phases"] == aligned["phases"]
    assert skewed["points"] == aligned["points"]
    assert skewed["clock_check"]["trace_minus_python_us"] == [-250000.0, -250000.0]
    assert aligned["clock_check"]["trace_minus_python_us"] == [0.0, 0.0]


def test_markers_are_found_by_address_without_memory_metadata() -> None:
    tagged, _ = recorded_resume(tags=True)
    untagged, _ = recorded_resume(tags=False)
    assert untagged["phases"] == tagged["phases"]
    assert untagged["points"] == tagged["points"]
    assert untagged["clock_check"]["markers_found"] == 6


def test_actions_that_do_not_change_allocated_bytes_are_ignored() -> None:
    skipped, _ = recorded_resume(honours_skip=True)  # only segment_alloc of the ignored kept
    recorded, _ = recorded_resume(honours_skip=False)  # a torch without skip_actions
    assert 0 < skipped["events"]["ignored"] < recorded["events"]["ignored"]  # + free_completed
    assert recorded["points"] == skipped["points"]
    assert recorded["peak_bytes_over_baseline"] == skipped["peak_bytes_over_baseline"]


def test_recording_options_and_disable() -> None:
    allocator = FakeAllocator()
    backend = FakeHistoryBackend(allocator)
    recorder = MemoryTimelineRecorder(0, backend=backend, max_entries=1234)
    recorder.start()
    assert backend.enabled_with == (1234, mt.SKIPPED_ACTIONS)
    assert not backend.disabled
    recorder.stop()
    assert backend.disabled


def test_other_devices_are_counted_not_mixed_in() -> None:
    allocator = FakeAllocator(device=1, devices=3)
    backend = FakeHistoryBackend(allocator)
    recorder = MemoryTimelineRecorder(0, backend=backend, clock_ns=python_clock(allocator))
    recorder.start()
    mine = allocator.alloc(10 * MIB)
    allocator.advance(10)
    allocator.alloc(999 * MIB, device=0)
    allocator.alloc(999 * MIB, device=2)
    allocator.advance(10)
    allocator.free(mine)
    timeline = recorder.stop()
    assert timeline["device"] == 1
    assert timeline["events"]["other_device_entries"] == 2
    assert timeline["peak_bytes_over_baseline"] == 10 * MIB
    assert timeline["consistency"]["peak_difference_bytes"] == 0


def test_ring_buffer_overflow_is_detected_and_anchored_at_the_end() -> None:
    complete, _ = recorded_resume(max_entries=100_000)
    # pass 2 (40 x staging segment_alloc, alloc and free, loaded free) and the last three
    # markers (alloc and free each) fit
    overflowed, allocator = recorded_resume(max_entries=170)
    assert complete["dropped_events"] is False
    assert complete["events"]["trace_entries"] < 100_000
    assert overflowed["dropped_events"] is True
    assert overflowed["events"]["trace_entries"] == 170
    assert overflowed["anchored_at"] == "end"
    baseline = overflowed["baseline_bytes"]
    assert overflowed["end_bytes_over_baseline"] == allocator.allocated - baseline
    assert overflowed["consistency"]["end_difference_bytes"] == 0
    # the retained tail still holds the peak of this load (pass 2's first staging copy)
    assert overflowed["peak_bytes_over_baseline"] == complete["peak_bytes_over_baseline"]
    assert overflowed["starts_at_s"] > 0.0
    # markers of the lost head fall back to the Python clock; the stop marker was kept
    check = overflowed["clock_check"]
    assert 0 < check["markers_found"] < check["markers_expected"]
    assert check["phase_times_from"] == "trace markers and the Python clock"
    assert _phase_labels(overflowed) == list(LOAD_PHASES)
    assert [p["start_s"] for p in overflowed["phases"]] == pytest.approx(
        [p["start_s"] for p in complete["phases"]], abs=2e-6
    )


def test_a_lost_peak_is_not_invented() -> None:
    complete, _ = recorded_resume()
    tail_only, _ = recorded_resume(max_entries=60)  # pass 2's first staging copy is lost
    assert tail_only["dropped_events"] is True
    assert tail_only["peak_bytes_over_baseline"] < complete["peak_bytes_over_baseline"]
    assert tail_only["consistency"]["peak_difference_bytes"] < -100 * MIB


def _entry(action: str, addr: int, size: int, time_us: int, meta: str = "") -> dict[str, Any]:
    """One trace entry as ``torch.cuda.memory._snapshot()`` returns it (no stack context)."""
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "stream": 0,
        "time_us": time_us,
        "compile_context": "",
        "user_metadata": meta,
        "frames": [],
    }


def test_tagged_markers_win_over_a_reused_address() -> None:
    tag = mt.MARKER_TAG_PREFIX
    t0 = 1_760_000_000_000_000
    address = 0x7000
    trace = [
        _entry("alloc", 0x1000, 1, t0, tag + "0"),
        _entry("free_requested", 0x1000, 1, t0),
        _entry("free_completed", 0x1000, 1, t0),
        _entry("alloc", address, 1, t0 + 10),  # somebody's 1-byte tensor at the marker's address
        _entry("free_requested", address, 1, t0 + 11),
        _entry("alloc", 0x9000, 4 * MIB, t0 + 15),
        _entry("alloc", address, 1, t0 + 20, tag + "1"),  # the marker of phase "a"
        _entry("free_requested", address, 1, t0 + 20),
        _entry("alloc", 0x2000, 1, t0 + 40, tag + "2"),
        _entry("free_requested", 0x2000, 1, t0 + 40),
        {"action": "oom", "device_free": 0, "size": 8 * MIB, "stream": 0, "time_us": t0 + 41},
    ]
    snapshot = {"segments": [], "device_traces": [trace], "allocator_settings": {}}
    boundaries = [
        Boundary(None, t0 * 1000, tag + "0", 0x1000),
        Boundary("a", (t0 + 19) * 1000, tag + "1", address),
        Boundary(None, (t0 + 40) * 1000, tag + "2", 0x2000),
    ]
    timeline = timeline_from_snapshot(
        snapshot, device=0, boundaries=boundaries, baseline_bytes=0, allocated_at_stop_bytes=4 * MIB
    )
    assert timeline["phases"] == [{"label": "a", "start_s": 0.00002, "end_s": 0.00004}]
    assert timeline["clock_check"]["trace_minus_python_us"] == [0.0, 1.0]
    assert timeline["events"]["oom"] == 1
    assert timeline["peak_bytes_over_baseline"] == 4 * MIB + 512
    assert timeline["end_bytes_over_baseline"] == 4 * MIB
    # Without tags the first 1-byte allocation at the address after the start marker is taken.
    untagged = [{**e, "user_metadata": ""} for e in trace]
    timeline = timeline_from_snapshot(
        {"device_traces": [untagged]}, device=0, boundaries=boundaries, baseline_bytes=0
    )
    assert timeline["phases"][0]["start_s"] == 0.00001


def test_misuse_raises() -> None:
    allocator = FakeAllocator()
    recorder = MemoryTimelineRecorder(0, backend=FakeHistoryBackend(allocator))
    with pytest.raises(TimelineUnavailable, match="not started"):
        recorder.mark("x")
    recorder.start()
    with pytest.raises(ValueError):
        recorder.mark("")
    with pytest.raises(TimelineUnavailable):
        recorder.start()
    recorder.stop()
    with pytest.raises(TimelineUnavailable, match="stopped"):
        recorder.stop()


def test_failed_start_disables_recording() -> None:
    class Failing(FakeHistoryBackend):
        def place_marker(self, tag: str) -> int:
            raise RuntimeError("no allocation")

    backend = Failing(FakeAllocator())
    with pytest.raises(RuntimeError):
        MemoryTimelineRecorder(0, backend=backend).start()
    assert backend.disabled


def test_end_phase_leaves_an_unlabelled_gap() -> None:
    spans = phase_spans([(None, 0.0), ("a", 1.0), (None, 2.0), ("b", 3.0), (None, 5.0)], 5.0)
    assert spans == [
        {"label": "a", "start_s": 1.0, "end_s": 2.0},
        {"label": "b", "start_s": 3.0, "end_s": 5.0},
    ]
    # out-of-order or out-of-range times are clamped into [0, end]
    assert phase_spans([(None, 0.0), ("a", -1.0), ("b", 9.0), (None, 9.0)], 4.0) == [
        {"label": "a", "start_s": 0.0, "end_s": 4.0},
        {"label": "b", "start_s": 4.0, "end_s": 4.0},
    ]


def test_snapshot_without_traces_is_an_error() -> None:
    boundaries = [Boundary(None, 0), Boundary(None, 1000)]
    with pytest.raises(ValueError, match="device_traces"):
        timeline_from_snapshot({"segments": []}, device=0, boundaries=boundaries, baseline_bytes=0)
    with pytest.raises(ValueError, match="time_us"):
        timeline_from_snapshot(
            {"device_traces": [[{"action": "alloc", "addr": 1, "size": 1}]]},
            device=0,
            boundaries=boundaries,
            baseline_bytes=0,
        )
    with pytest.raises(ValueError, match="boundaries"):
        timeline_from_snapshot(
            {"device_traces": [[]]}, device=0, boundaries=boundaries[:1], baseline_bytes=0
        )


def test_empty_trace_gives_a_flat_timeline() -> None:
    boundaries = [Boundary(None, 1_000_000), Boundary("a", 2_000_000), Boundary(None, 3_000_000)]
    timeline = timeline_from_snapshot(
        {"device_traces": [[]]},
        device=0,
        boundaries=boundaries,
        baseline_bytes=100,
        allocated_at_stop_bytes=100,
        max_allocated_bytes=100,
    )
    assert timeline["peak_bytes_over_baseline"] == 0
    assert timeline["clock_check"]["phase_times_from"] == "the Python clock"
    assert timeline["phases"] == [{"label": "a", "start_s": 0.001, "end_s": 0.002}]
    assert not timeline_problems(timeline)


def test_without_cuda_the_recorders_say_so() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(TimelineUnavailable, match="no CUDA"):
        MemoryTimelineRecorder(0)
    with pytest.raises(TimelineUnavailable, match="no CUDA"):
        SampledMemoryTimelineRecorder(0)
    with pytest.raises(TimelineUnavailable, match="no CUDA"):
        mt.start_recorder(0)


# --------------------------------------------------------------------------------------------
# Downsampling
# --------------------------------------------------------------------------------------------


def _random_walk(count: int, seed: int = 0) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    t, level, points = 0.0, 0, [(0.0, 0)]
    for _ in range(count):
        t += rng.expovariate(1000.0) if rng.random() < 0.9 else rng.uniform(0.0, 0.5)
        level += rng.randint(-50, 55) * MIB
        points.append((t, level))
    return points


@pytest.mark.parametrize("max_points", [8, 100, 1500])
def test_downsampling_keeps_every_bucket_extreme_and_the_peak(max_points: int) -> None:
    points = _random_walk(50_000)
    kept = downsample(points, max_points)
    assert len(kept) <= max_points
    assert kept[0] == points[0] and kept[-1] == points[-1]
    peak = max(points, key=lambda p: p[1])
    first_peak = next(p for p in points if p[1] == peak[1])
    assert first_peak in kept
    buckets = (max_points - 3) // 3
    assert bucket_extremes(kept, buckets) == bucket_extremes(points, buckets)
    assert kept == sorted(kept, key=lambda p: p[0])
    assert set(kept) <= set(points)


def test_downsampling_keeps_short_series_and_handles_zero_duration() -> None:
    short = _random_walk(100)
    assert downsample(short, 1500) == short
    same_time = [(1.0, v) for v in range(5000)] + [(1.0, -3)]
    kept = downsample(same_time, 50)
    assert len(kept) <= 50
    assert (1.0, 4999) in kept and (1.0, -3) in kept and (1.0, 0) in kept
    with pytest.raises(ValueError):
        downsample(short, 5)


def test_a_long_trace_is_downsampled_in_the_result() -> None:
    allocator = FakeAllocator()
    recorder = MemoryTimelineRecorder(
        0, backend=FakeHistoryBackend(allocator), clock_ns=python_clock(allocator), max_points=300
    )
    recorder.start()
    rng = random.Random(1)
    held: list[int] = []
    for _ in range(5000):
        if held and rng.random() < 0.45:
            allocator.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(allocator.alloc(rng.randint(1, 10 * MIB)))
        allocator.advance(rng.randint(1, 300))
    timeline = recorder.stop()
    assert timeline["points_before_downsampling"] > 5000
    assert len(timeline["points"]) <= 300
    assert [timeline["peak_t_s"], timeline["peak_bytes_over_baseline"]] in timeline["points"]
    assert max(v for _, v in timeline["points"]) == timeline["peak_bytes_over_baseline"]
    assert timeline["consistency"]["peak_difference_bytes"] == 0


# --------------------------------------------------------------------------------------------
# Sampling fallback
# --------------------------------------------------------------------------------------------


class _Reader:
    device = 0

    def __init__(self, allocated: int) -> None:
        self.allocated = allocated
        self.peak = allocated

    def read(self) -> tuple[int, int]:
        return self.allocated, self.peak

    def set(self, allocated: int) -> None:
        self.allocated = allocated
        self.peak = max(self.peak, allocated)


def test_sampled_timeline_puts_the_peak_between_samples_on_the_curve() -> None:
    reader = _Reader(1000 * MIB)
    clock = [0]
    recorder = SampledMemoryTimelineRecorder(
        reader.allocated, reader=reader, clock_ns=lambda: clock[0]
    )
    recorder.start()
    recorder.mark("a")
    for level in (1010, 1020, 1030):
        clock[0] += 1_000_000
        reader.set(level * MIB)
        recorder.sample_once()
    reader.set(1500 * MIB)  # a spike no sample sees
    reader.set(1040 * MIB)
    clock[0] += 1_000_000
    recorder.sample_once()
    recorder.mark("b")
    clock[0] += 1_000_000
    reader.set(990 * MIB)
    recorder.sample_once()
    clock[0] += 1_000_000
    timeline = recorder.stop()
    assert timeline["source"] == mt.SOURCE_SAMPLED
    assert timeline["peak_bytes_over_baseline"] == 500 * MIB
    assert timeline["peak_t_s"] == pytest.approx(0.0035)
    assert timeline["consistency"]["peak_difference_bytes"] == 0
    assert timeline["end_bytes_over_baseline"] == -10 * MIB
    assert timeline["events"]["peak_points_inserted"] == 1
    assert _phase_labels(timeline) == ["a", "b"]
    assert timeline["phases"][1] == {"label": "b", "start_s": 0.004, "end_s": 0.006}
    assert not timeline_problems(timeline)


def test_sampling_thread_runs_and_stops() -> None:
    reader = _Reader(0)
    recorder = SampledMemoryTimelineRecorder(0, reader=reader, interval_s=0.0005)
    recorder.start()
    recorder.mark(LOAD_PHASES[0])
    for level in range(1, 40):
        reader.set(level * MIB)
        time.sleep(0.0005)
    timeline = recorder.stop()
    assert timeline["events"]["samples"] >= 3
    assert timeline["peak_bytes_over_baseline"] == 39 * MIB
    assert timeline["consistency"]["peak_difference_bytes"] == 0


def test_sampling_errors_are_reported() -> None:
    class Broken(_Reader):
        calls = 0

        def read(self) -> tuple[int, int]:
            self.calls += 1
            if self.calls > 2:
                raise RuntimeError("stats gone")
            return 0, 0

    recorder = SampledMemoryTimelineRecorder(0, reader=Broken(0), interval_s=0.0001)
    recorder.start()
    time.sleep(0.01)
    with pytest.raises(TimelineUnavailable, match="sampling failed"):
        recorder.stop()


# --------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------


def test_json_round_trip_and_shape() -> None:
    timeline, _ = recorded_resume()
    text = json.dumps(timeline)
    assert json.loads(text) == timeline
    assert not timeline_problems(json.loads(text))
    assert set(timeline) >= {
        "unit",
        "baseline_bytes",
        "points",
        "phases",
        "peak_bytes_over_baseline",
        "peak_t_s",
        "source",
        "dropped_events",
    }
    assert len(text) < 60_000


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"unit": "MiB"}, "unit"),
        ({"source": "guess"}, "source"),
        ({"points": []}, "no points"),
        ({"points": [[0.0, 1], [1.0]]}, "malformed point"),
        ({"points": [[1.0, 1], [0.5, 2]]}, "time order"),
        ({"phases": [{"label": "x"}]}, "malformed phase"),
        ({"peak_t_s": None}, "peak_t_s"),
    ],
)
def test_timeline_problems_are_found(change: dict[str, Any], problem: str) -> None:
    timeline, _ = recorded_resume()
    assert any(problem in p for p in timeline_problems({**timeline, **change}))
    assert timeline_problems([1, 2]) == ["not a JSON object"]


# --------------------------------------------------------------------------------------------
# Figures (matplotlib)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def figures() -> Any:
    pytest.importorskip("matplotlib", reason="figures need matplotlib (requirements/test.txt)")
    from benchmarks.resume_benchmark import figures as module

    return module


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _two_sides() -> dict[str, Any]:
    upstream, _ = recorded_resume(scaffold_bytes_per_param=12, seconds=5.0)
    build, _ = recorded_resume(scaffold_bytes_per_param=4, seconds=4.0)
    return {"upstream": upstream, "build": build}


def _document(sides: dict[str, Any], *, multi_rank: bool = False) -> dict[str, Any]:
    params = 50_000_000
    if not multi_rank:
        return {
            "cases": [
                {
                    "case": "dp_reshardable",
                    "params_on_rank": params,
                    "sides": {
                        label: {"status": "ok", "params_on_rank": params, "memory_timeline": t}
                        for label, t in sides.items()
                    },
                },
                {"case": "moe", "params_on_rank": params, "sides": {"upstream": {"status": "ok"}}},
                {"case": "fully_sharded_model_space", "status": "unsupported"},
            ]
        }
    return {
        "cases": [
            {
                "case": "precision_aware_bf16",
                "parallel": {"resharded": False},
                "rank_sides": {
                    label: [
                        {"rank": r, "params_on_rank": params + r, "memory_timeline": t}
                        for r in range(2)
                    ]
                    for label, t in sides.items()
                },
            }
        ]
    }


def test_figure_is_a_small_png(figures: Any, tmp_path: Path) -> None:
    timelines = figures.CaseTimelines("dp_reshardable", _two_sides(), params=50_000_000)
    path = figures.render_case_figure(timelines, tmp_path / "out" / "dp_reshardable.png")
    width, height = _png_size(path)
    assert (width, height) == (round(figures.FIGSIZE[0] * 110), round(figures.FIGSIZE[1] * 110))
    assert 10_000 < path.stat().st_size < 150_000


def test_figure_is_deterministic(figures: Any, tmp_path: Path) -> None:
    timelines = figures.CaseTimelines("dp_reshardable", _two_sides(), params=50_000_000)
    first = figures.render_case_figure(timelines, tmp_path / "a.png").read_bytes()
    second = figures.render_case_figure(timelines, tmp_path / "b.png").read_bytes()
    assert first == second


def test_figure_with_one_sampled_side_and_no_parameter_count(figures: Any, tmp_path: Path) -> None:
    reader = _Reader(0)
    clock = [0]
    recorder = SampledMemoryTimelineRecorder(0, reader=reader, clock_ns=lambda: clock[0])
    recorder.start()
    recorder.mark(LOAD_PHASES[1])
    for level in range(50):
        clock[0] += 1_000_000
        reader.set((level % 17 - 4) * MIB)
        recorder.sample_once()
    timeline = recorder.stop()
    timelines = figures.CaseTimelines("moe", {"build": timeline, "broken": {"unit": "?"}})
    path = figures.render_case_figure(timelines, tmp_path / "moe.png")
    assert _png_size(path)[0] > 0
    with pytest.raises(ValueError, match="no usable timeline"):
        figures.render_case_figure(figures.CaseTimelines("x", {"a": {}}), tmp_path / "x.png")


def test_cases_with_timelines_are_found(figures: Any) -> None:
    sides = _two_sides()
    single = figures.case_timelines(_document(sides))
    assert [(c.case, c.params, c.multi_rank, list(c.sides)) for c in single] == [
        ("dp_reshardable", 50_000_000, False, ["upstream", "build"])
    ]
    multi = figures.case_timelines(_document(sides, multi_rank=True))
    assert [(c.case, c.rank, c.params) for c in multi] == [("precision_aware_bf16", 0, 50_000_000)]
    every = figures.case_timelines(_document(sides, multi_rank=True), all_ranks=True)
    assert [(c.rank, c.params) for c in every] == [(0, 50_000_000), (1, 50_000_001)]
    assert [figures.figure_name(c, True) for c in every] == [
        "precision_aware_bf16.rank0.png",
        "precision_aware_bf16.rank1.png",
    ]
    assert figures.figure_name(multi[0], False) == "precision_aware_bf16.png"


def test_cli_writes_one_png_per_case_and_markdown(figures: Any, tmp_path: Path) -> None:
    sides = _two_sides()
    first = tmp_path / "a.json"
    second = tmp_path / "b.json"
    first.write_text(json.dumps(_document(sides)))
    both = _document(sides)["cases"] + _document(sides, multi_rank=True)["cases"]
    second.write_text(json.dumps({"cases": both}))
    out = tmp_path / "report" / "figures"
    markdown = tmp_path / "report" / "figures.md"
    status = figures.main(
        [str(first), str(second), "--out-dir", str(out), "--markdown-out", str(markdown)]
    )
    assert status == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["dp_reshardable-2.png", "dp_reshardable.png", "precision_aware_bf16.png"]
    lines = [line for line in markdown.read_text().splitlines() if line]
    assert lines == [
        "![dp_reshardable: allocated GPU memory during the resume](figures/dp_reshardable.png)",
        "![dp_reshardable: allocated GPU memory during the resume](figures/dp_reshardable-2.png)",
        "![precision_aware_bf16 (rank 0): allocated GPU memory during the resume]"
        "(figures/precision_aware_bf16.png)",
    ]
    status = figures.main([str(first), "--out-dir", str(tmp_path / "only"), "--cases", "moe"])
    assert status == 1


def test_a_failed_recording_is_noted_not_drawn(figures: Any, tmp_path: Path) -> None:
    sides = _two_sides()
    document = _document({"upstream": sides["upstream"], "build": {"error": "RuntimeError: x"}})
    (found,) = figures.case_timelines(document)
    assert list(found.sides) == ["upstream"]
    assert found.notes == ("build: no timeline (RuntimeError: x)",)
    nothing = _document({"build": {"error": "RuntimeError: x"}})
    assert figures.write_figures([nothing], tmp_path) == []
    written = figures.write_figures([document], tmp_path)
    assert [p.name for _, p in written] == ["dp_reshardable.png"]


def test_memory_timeline_imports_neither_torch_nor_matplotlib() -> None:
    code = (
        "import sys, benchmarks.resume_benchmark.memory_timeline; "
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"
