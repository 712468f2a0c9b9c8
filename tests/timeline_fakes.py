"""CPU stand-ins for the CUDA caching allocator's trace, for the memory-timeline tests.

:class:`FakeAllocator` keeps ``memory_allocated()``/``max_memory_allocated()`` the way the
caching allocator does (the *block* size: the request rounded up to 512 B, plus any slack of a
block it did not split) and records trace entries shaped like
``torch.cuda.memory._snapshot()["device_traces"][device]`` entries: ``action``, ``addr``,
``size`` (the *requested* size), ``stream``, ``time_us`` (epoch microseconds), ``compile_context``,
``user_metadata`` (the thread's memory metadata), ``frames`` -- in a ring buffer of ``max_entries``
that overwrites the oldest entries, returned oldest first. ``free`` records ``free_requested``
(the allocated bytes drop here) and then ``free_completed``; a large request records the
``segment_alloc`` of its new segment first (taken whole when at most 1 MiB would remain, as the
allocator does); actions listed in ``skip_actions`` are not recorded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.resume_benchmark.memory_timeline import (
    LOAD_PHASES,
    SMALL_SIZE,
    MemoryTimelineRecorder,
    block_bytes,
)

EPOCH_US = 1_760_000_000_000_000  # some time in 2025, in microseconds
MIB = 1 << 20


def segment_bytes(size: int) -> int:
    """The size of the segment the caching allocator creates for a request of ``size`` bytes
    (2 MiB up to 1 MiB, 20 MiB below 10 MiB, else the request rounded up to 2 MiB)."""
    if size <= SMALL_SIZE:
        return 2 * MIB
    if size < 10 * MIB:
        return 20 * MIB
    return -(-size // (2 * MIB)) * (2 * MIB)


class FakeAllocator:
    """The allocator statistics and trace of ``devices`` devices; allocations go to ``device``."""

    def __init__(self, device: int = 0, devices: int = 2, baseline_bytes: int = 0) -> None:
        self.device = device
        self.now_us = EPOCH_US
        self.allocated = baseline_bytes
        self.peak = baseline_bytes
        self.blocks: dict[int, tuple[int, int]] = {}  # address -> (requested, block size)
        self.next_address = 0x7F00_0000_0000
        self.metadata = ""
        self.recording = False
        self.max_entries = 0
        self.skip: set[str] = set()
        self.traces: list[list[dict[str, Any]]] = [[] for _ in range(devices)]
        self.ring_next = [0] * devices

    # -- clock ---------------------------------------------------------------------------------

    def advance(self, microseconds: float) -> None:
        self.now_us += int(microseconds)

    # -- allocations ---------------------------------------------------------------------------

    def alloc(self, size: int, *, slack: int = 0, device: int | None = None) -> int:
        """Allocate ``size`` bytes; return the address.

        ``slack`` > 0: reuse a cached block ``slack`` bytes larger than the rounded request
        (not split; invisible in the trace). Otherwise a large request (over 1 MiB) gets a new
        segment sized as the caching allocator sizes it, taken whole when at most 1 MiB of it
        would remain.
        """
        address = self.next_address
        target = self.device if device is None else device
        block = block_bytes(size)
        if target == self.device and size > SMALL_SIZE and not slack:
            segment = segment_bytes(size)
            self._record("segment_alloc", address, segment, target)
            if segment - block <= SMALL_SIZE:
                block = segment
        block += slack
        self.next_address += block + 4096
        if target == self.device:
            self.blocks[address] = (size, block)
            self.allocated += block
            self.peak = max(self.peak, self.allocated)
        self._record("alloc", address, size, target)
        return address

    def free(self, address: int) -> None:
        requested, block = self.blocks.pop(address)
        self.allocated -= block
        self._record("free_requested", address, requested, self.device)
        self._record("free_completed", address, requested, self.device)

    def reset_peak(self) -> None:
        self.peak = self.allocated

    # -- trace ---------------------------------------------------------------------------------

    def _record(self, action: str, address: int, size: int, device: int) -> None:
        if not self.recording or action in self.skip:
            return
        entry = {
            "action": action,
            "addr": address,
            "size": size,
            "stream": 0,
            "time_us": self.now_us,
            "compile_context": "",
            "user_metadata": self.metadata,
            "frames": [],
        }
        trace = self.traces[device]
        if len(trace) < self.max_entries:
            trace.append(entry)
        else:
            trace[self.ring_next[device]] = entry
            self.ring_next[device] = (self.ring_next[device] + 1) % self.max_entries

    def snapshot(self) -> dict[str, Any]:
        traces = []
        for device, trace in enumerate(self.traces):
            cut = self.ring_next[device] if len(trace) >= self.max_entries else 0
            traces.append([dict(e) for e in trace[cut:] + trace[:cut]])
        return {"segments": [], "device_traces": traces, "allocator_settings": {}}


class FakeHistoryBackend:
    """:class:`~benchmarks.resume_benchmark.memory_timeline.HistoryBackend` on a FakeAllocator.

    ``honours_skip``: False imitates a torch without ``skip_actions``; ``tags``: False one
    without memory metadata (markers then found by address).
    """

    def __init__(
        self, allocator: FakeAllocator, *, honours_skip: bool = True, tags: bool = True
    ) -> None:
        self.allocator = allocator
        self.device = allocator.device
        self.honours_skip = honours_skip
        self.tags = tags
        self.enabled_with: tuple[int, tuple[str, ...]] | None = None
        self.disabled = False

    def enable(self, max_entries: int, skip_actions: Sequence[str]) -> None:
        self.enabled_with = (max_entries, tuple(skip_actions))
        a = self.allocator
        a.recording, a.max_entries = True, max_entries
        a.skip = set(skip_actions) if self.honours_skip else set()
        a.traces = [[] for _ in a.traces]
        a.ring_next = [0] * len(a.traces)

    def disable(self) -> None:
        self.allocator.recording = False
        self.disabled = True

    def snapshot(self) -> Mapping[str, Any]:
        return self.allocator.snapshot()

    def place_marker(self, tag: str) -> int:
        a = self.allocator
        previous = a.metadata
        if self.tags:
            a.metadata = tag
        address = a.alloc(1)
        a.metadata = previous
        a.free(address)
        return address

    def allocated_bytes(self) -> int:
        return self.allocator.allocated

    def max_allocated_bytes(self) -> int:
        return self.allocator.peak


def python_clock(allocator: FakeAllocator, skew_us: int = 0) -> Any:
    """A ``time.time_ns`` stand-in reading the allocator's clock (shifted by ``skew_us``)."""
    return lambda: (allocator.now_us + skew_us) * 1000


def synthetic_resume(
    allocator: FakeAllocator,
    recorder: Any,
    *,
    params: int,
    scaffold_bytes_per_param: int,
    seconds: float = 4.0,
    tensors: int = 40,
) -> None:
    """A resume-shaped load between ``recorder.start()`` and before ``stop()``.

    Pass 1 allocates the optimizer scaffold (``scaffold_bytes_per_param`` B/param, held), the
    read allocates 12 B/param of loaded tensors in ``tensors`` pieces, the model load copies
    nothing new, pass 2 allocates and frees a staging copy per tensor and then drops the loaded
    tensors. Deterministic; the clock advances ``seconds`` in total.
    """
    step = seconds * 1e6 / (4 * tensors + 8)
    recorder.mark(LOAD_PHASES[0])
    scaffold = []
    for _ in range(tensors):
        scaffold.append(allocator.alloc(scaffold_bytes_per_param * params // tensors))
        allocator.advance(step)
    recorder.mark(LOAD_PHASES[1])
    loaded = []
    for index in range(tensors):
        loaded.append(allocator.alloc(12 * params // tensors, slack=512 if index == 3 else 0))
        small = allocator.alloc(3000)
        allocator.advance(step)
        allocator.free(small)
        allocator.advance(step / 2)
    recorder.mark(LOAD_PHASES[2])
    allocator.advance(step * 4)
    recorder.mark(LOAD_PHASES[3])
    for address in loaded:
        staging = allocator.alloc(4 * params // tensors)
        allocator.advance(step / 2)
        allocator.free(staging)
        allocator.free(address)
        allocator.advance(step / 2)
    del scaffold  # the scaffold is the optimizer state: it stays allocated


def recorded_resume(
    *,
    params: int = 50_000_000,
    scaffold_bytes_per_param: int = 12,
    baseline_bytes: int = 3 << 30,
    max_entries: int = 100_000,
    skew_us: int = 0,
    tags: bool = True,
    honours_skip: bool = True,
    seconds: float = 4.0,
) -> tuple[dict[str, Any], FakeAllocator]:
    """A full recorded synthetic resume: the timeline and the allocator it ran on."""
    allocator = FakeAllocator(baseline_bytes=baseline_bytes)
    allocator.reset_peak()
    backend = FakeHistoryBackend(allocator, honours_skip=honours_skip, tags=tags)
    recorder = MemoryTimelineRecorder(
        allocator.allocated,
        backend=backend,
        max_entries=max_entries,
        clock_ns=python_clock(allocator, skew_us),
    )
    recorder.start()
    allocator.advance(50)
    synthetic_resume(
        allocator,
        recorder,
        params=params,
        scaffold_bytes_per_param=scaffold_bytes_per_param,
        seconds=seconds,
    )
    allocator.advance(50)
    return recorder.stop(), allocator
