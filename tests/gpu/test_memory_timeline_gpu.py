"""The memory-timeline recorders on a real CUDA caching allocator (needs a GPU, not TE).

Checks what the CPU tests can only assume: that the trace of ``_record_memory_history`` holds
the marker allocations (tagged), that alloc/free_requested with 512-byte rounding (and whole
new segments where the allocator does not split them) reproduce
``memory_allocated()``/``max_memory_allocated()`` exactly for this workload, and how far the
trace's ``time_us`` is from Python's ``time.time_ns()`` (printed; only loosely bounded).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.resume_benchmark.memory_timeline import (
    SOURCE_HISTORY,
    SOURCE_SAMPLED,
    MemoryTimelineRecorder,
    SampledMemoryTimelineRecorder,
    start_recorder,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU test: needs a CUDA GPU"),
]

MIB = 1 << 20


def _fresh_baseline() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _workload(recorder: MemoryTimelineRecorder | SampledMemoryTimelineRecorder) -> None:
    recorder.mark("one")
    # 15.3 MiB: a new 16 MiB segment, which the allocator does not split (0.7 MiB would remain)
    odd = torch.empty(16_043_213, dtype=torch.uint8, device="cuda")
    big = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    small = [torch.empty(1000, device="cuda") for _ in range(100)]
    recorder.mark("two")
    other = torch.empty(32 * MIB, dtype=torch.uint8, device="cuda")
    del big
    reused = torch.empty(16 * MIB, dtype=torch.uint8, device="cuda")
    del small
    recorder.end_phase()
    torch.cuda.synchronize()
    del other, reused, odd


def test_history_reproduces_the_allocator_statistics() -> None:
    baseline = _fresh_baseline()
    recorder = MemoryTimelineRecorder(baseline)
    recorder.start()
    _workload(recorder)
    timeline = recorder.stop()
    print({k: v for k, v in timeline.items() if k != "points"})
    assert timeline["source"] == SOURCE_HISTORY
    assert timeline["dropped_events"] is False
    check = timeline["clock_check"]
    assert check["markers_found"] == check["markers_expected"] == 5  # start, one, two, end, stop
    assert [p["label"] for p in timeline["phases"]] == ["one", "two"]
    assert timeline["consistency"]["peak_difference_bytes"] == 0
    assert timeline["consistency"]["end_difference_bytes"] == 0
    assert timeline["peak_bytes_over_baseline"] == torch.cuda.max_memory_allocated() - baseline
    assert timeline["peak_bytes_over_baseline"] >= (64 + 32) * MIB
    low, high = timeline["clock_check"]["trace_minus_python_us"]
    assert -50_000 < low <= high < 50_000  # time_us is epoch microseconds, like time.time_ns()


def test_sampled_recorder_keeps_the_peak() -> None:
    baseline = _fresh_baseline()
    recorder = SampledMemoryTimelineRecorder(baseline)
    recorder.start()
    _workload(recorder)
    timeline = recorder.stop()
    assert timeline["source"] == SOURCE_SAMPLED
    assert timeline["consistency"]["peak_difference_bytes"] == 0
    assert [p["label"] for p in timeline["phases"]] == ["one", "two"]


def test_start_recorder_prefers_memory_history() -> None:
    recorder = start_recorder(_fresh_baseline())
    try:
        assert recorder.source == SOURCE_HISTORY
    finally:
        recorder.stop()
