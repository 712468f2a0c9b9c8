"""The memory-timeline recorder on a real CUDA caching allocator (needs a GPU, not TE).

Checks what the CPU tests can only assume: that torch's snapshot holds the ``record_function``
ranges of the phases as ``external_annotations`` (``phase_clock == "record_function"``), and that
alloc/free_requested with 512-byte rounding (and whole new segments where the allocator does not
split them) reproduce ``memory_allocated()``/``max_memory_allocated()`` exactly for this workload.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.resume_benchmark.memory_timeline import SOURCE_HISTORY, LoadTimeline

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU test: needs a CUDA GPU"),
]

MIB = 1 << 20


def test_history_reproduces_the_allocator_statistics() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    recorder = LoadTimeline(baseline)
    recorder.start()
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
    torch.cuda.synchronize()
    timeline = recorder.stop()
    del other, reused, odd
    print({k: v for k, v in timeline.items() if k != "points"})
    assert timeline["source"] == SOURCE_HISTORY
    assert timeline["dropped_events"] is False
    assert timeline["phase_clock"] == "record_function"
    assert [p["label"] for p in timeline["phases"]] == ["one", "two"]
    assert timeline["consistency"]["peak_difference_bytes"] == 0
    assert timeline["consistency"]["end_difference_bytes"] == 0
    assert timeline["peak_bytes_over_baseline"] == torch.cuda.max_memory_allocated() - baseline
    assert timeline["peak_bytes_over_baseline"] >= (64 + 32) * MIB
