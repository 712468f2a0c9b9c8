"""Memory timelines of the resume benchmark, on the CPU.

The recorder's input is torch's own allocator snapshot (``torch.cuda.memory._snapshot()``): here
snapshots are written out as data in that format -- ``device_traces`` entries with ``action``,
``addr``, ``size`` (the requested bytes), ``time_us``, and ``external_annotations`` with the
``record_function`` ranges -- and the accounting of the caching allocator (a block is the
request rounded up to 512 B, or a whole new segment taken unsplit). The GPU test
(tests/gpu/test_memory_timeline_gpu.py) checks the same against the real allocator. Figures need
matplotlib (requirements/test.txt).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.resume_benchmark.memory_timeline import (
    LOAD_PHASES,
    RECORDING,
    allocation_levels,
    allocator_rounding,
    block_bytes,
    downsample,
    timeline_from_snapshot,
    timeline_problems,
)

MIB = 1 << 20


class Trace:
    """A device trace and its annotations, written as torch's snapshot holds them."""

    def __init__(self, start_us: int = 1_000_000) -> None:
        self.now = start_us
        self.entries: list[dict[str, Any]] = []
        self.annotations: list[dict[str, Any]] = []
        self._next_address = 1 << 32

    def _entry(self, action: str, address: int, size: int, device: int = 0) -> None:
        self.now += 10
        self.entries.append(
            {"action": action, "addr": address, "size": size, "time_us": self.now, "device": device}
        )

    def alloc(self, size: int, new_segment: int | None = None) -> int:
        address = self._next_address
        self._next_address += block_bytes(size) + (new_segment or 0) + 4096
        if new_segment is not None:
            self._entry("segment_alloc", address, new_segment)
        self._entry("alloc", address, size)
        return address

    def free(self, address: int, size: int) -> None:
        self._entry("free_requested", address, size)
        self._entry("free_completed", address, size)

    def annotate(self, name: str) -> int:
        self.now += 10
        self.annotations.append({"device": 0, "stage": "START", "name": name, "time_us": self.now})
        return self.now

    def snapshot(self) -> dict[str, Any]:
        return {"device_traces": [self.entries], "external_annotations": self.annotations}


def synthetic_load(
    trace: Trace, params: int, scaffold_bytes_per_param: int
) -> list[tuple[str, int]]:
    """A load's four phases: scaffold, read buffers, model copy, payload; returns the marks."""
    marks = [(RECORDING, trace.annotate(RECORDING))]
    marks.append((LOAD_PHASES[0], trace.annotate(LOAD_PHASES[0])))
    scaffold = trace.alloc(
        scaffold_bytes_per_param * params, new_segment=scaffold_bytes_per_param * params
    )
    marks.append((LOAD_PHASES[1], trace.annotate(LOAD_PHASES[1])))
    buffer = trace.alloc(64 * MIB)
    trace.free(buffer, 64 * MIB)
    marks.append((LOAD_PHASES[2], trace.annotate(LOAD_PHASES[2])))
    small = [trace.alloc(100) for _ in range(5)]
    for address in small:
        trace.free(address, 100)
    marks.append((LOAD_PHASES[3], trace.annotate(LOAD_PHASES[3])))
    trace.free(scaffold, scaffold_bytes_per_param * params)
    return marks


def recorded_resume(
    *, params: int = 50_000_000, scaffold_bytes_per_param: int = 12, seconds: float = 4.0
) -> dict[str, Any]:
    """A timeline of a synthetic load lasting ``seconds``."""
    trace = Trace()
    marks = synthetic_load(trace, params, scaffold_bytes_per_param)
    return timeline_from_snapshot(
        trace.snapshot(),
        0,
        marks,
        baseline_bytes=3 << 30,
        stopped_us=marks[0][1] + int(seconds * 1e6),
    )


@pytest.mark.parametrize(
    ("requested", "block"), [(1, 512), (511, 512), (512, 512), (513, 1024), (MIB + 1, MIB + 512)]
)
def test_block_bytes_rounds_like_the_caching_allocator(requested: int, block: int) -> None:
    assert block_bytes(requested) == block


def test_levels_count_blocks_and_whole_new_segments() -> None:
    trace = Trace()
    a = trace.alloc(1000)  # 1024 B block
    b = trace.alloc(15 * MIB + 300_000, new_segment=16 * MIB)  # taken whole: 16 MiB
    c = trace.alloc(4 * MIB, new_segment=20 * MIB)  # split: the rounded request only
    trace.free(b, 15 * MIB + 300_000)  # returns what the alloc took
    trace.free(0xDEAD, 700)  # allocated before the recording: its rounded size
    levels = [level for _, level in allocation_levels(trace.entries)]
    assert levels == [1024, 1024 + 16 * MIB, 1024 + 20 * MIB, 1024 + 4 * MIB, 1024 + 4 * MIB - 1024]
    assert a and c


def test_rounding_is_read_from_the_segments_blocks() -> None:
    trace = Trace()
    before = 0x1000  # held, allocated before the recording: not in the trace
    scaffold = trace.annotate(LOAD_PHASES[0])
    whole = trace.alloc(33 * MIB + MIB // 4, new_segment=34 * MIB)  # a 33.25 MiB moment
    split = trace.alloc(4 * MIB, new_segment=20 * MIB)
    freed = trace.alloc(8 * MIB)
    trace.free(freed, 8 * MIB)
    read = trace.annotate(LOAD_PHASES[1])
    tiny = trace.alloc(100)
    snapshot = trace.snapshot()
    snapshot["segments"] = [
        {"device": 0, "address": before, "blocks": [
            {"size": MIB, "requested_size": MIB, "state": "active_allocated"}]},
        {"device": 0, "address": whole, "blocks": [
            {"size": 34 * MIB, "requested_size": 33 * MIB + MIB // 4, "state": "active_allocated"}]},
        {"device": 0, "address": split, "blocks": [
            {"size": 4 * MIB, "requested_size": 4 * MIB, "state": "active_allocated"},
            {"size": 16 * MIB, "requested_size": 0, "state": "inactive"}]},
        {"device": 0, "address": tiny, "blocks": [
            {"size": 512, "requested_size": 100, "state": "active_allocated"}]},
        {"device": 1, "address": 0, "blocks": [
            {"size": 2 * MIB, "requested_size": 1, "state": "active_allocated"}]},
    ]  # fmt: skip
    rounding = allocator_rounding(snapshot, 0, [(LOAD_PHASES[0], scaffold), (LOAD_PHASES[1], read)])
    assert rounding["blocks"] == 3, "a block allocated before the load is not the load's"
    assert rounding["rounding_bytes"] == 3 * MIB // 4 + 412
    assert rounding["phases"] == {
        LOAD_PHASES[0]: [2, 37 * MIB + MIB // 4, 38 * MIB],
        LOAD_PHASES[1]: [1, 100, 512],
    }
    assert rounding["largest"][0] == [33 * MIB + MIB // 4, 34 * MIB, 1, LOAD_PHASES[0]]
    assert len(rounding["largest"]) == 2, "blocks without rounding are not listed"


def test_actions_that_do_not_change_allocated_bytes_are_ignored() -> None:
    trace = Trace()
    trace.alloc(512)
    for action in (
        "free_completed",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "snapshot",
        "oom",
    ):
        trace._entry(action, 1, 1 << 30)
    assert [level for _, level in allocation_levels(trace.entries)] == [512]


def test_timeline_of_a_load() -> None:
    params = 1_000_000
    trace = Trace()
    marks = synthetic_load(trace, params, 12)
    peak = 12 * params + 64 * MIB
    timeline = timeline_from_snapshot(
        trace.snapshot(),
        0,
        marks,
        baseline_bytes=5 << 30,
        stopped_us=trace.now + 100,
        allocated_peak=(5 << 30) + block_bytes(12 * params) + 64 * MIB,
        allocated_end=5 << 30,
    )
    assert timeline_problems(timeline) == []
    assert timeline["peak_bytes_over_baseline"] == 12 * params + 64 * MIB == peak
    assert timeline["end_bytes_over_baseline"] == 0
    assert timeline["consistency"] == {
        "peak_difference_bytes": 12 * params - block_bytes(12 * params),
        "end_difference_bytes": 0,
    }
    assert [p["label"] for p in timeline["phases"]] == list(LOAD_PHASES)
    assert timeline["phase_clock"] == "record_function"
    spans = [(p["start_s"], p["end_s"]) for p in timeline["phases"]]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "phases tile the load"
    assert spans[-1][1] == timeline["duration_s"]
    assert json.loads(json.dumps(timeline)) == timeline


def test_phases_come_from_the_trace_clock_when_annotated() -> None:
    trace = Trace()
    marks = synthetic_load(trace, 1000, 12)
    skewed = [(label, t + 5_000_000) for label, t in marks]  # Python's clock 5 s off
    annotated = timeline_from_snapshot(trace.snapshot(), 0, skewed, baseline_bytes=0, stopped_us=0)
    exact = timeline_from_snapshot(trace.snapshot(), 0, marks, baseline_bytes=0, stopped_us=0)
    assert annotated["phases"] == exact["phases"]
    bare = {"device_traces": [trace.entries]}
    clock = timeline_from_snapshot(bare, 0, skewed, baseline_bytes=0, stopped_us=0)
    assert clock["phase_clock"] == "wall clock"
    assert [p["start_s"] for p in clock["phases"]] == [p["start_s"] for p in exact["phases"]]
    assert clock["points"][1][0] == 0.0, "events before the skewed start are clamped to 0"


def test_other_devices_are_not_mixed_in() -> None:
    trace, other = Trace(), Trace()
    trace.alloc(512)
    other.alloc(1 << 30)
    snapshot = {"device_traces": [trace.entries, other.entries]}
    marks = [(RECORDING, trace.entries[0]["time_us"] - 1)]
    assert (
        timeline_from_snapshot(snapshot, 0, marks, baseline_bytes=0, stopped_us=0)[
            "peak_bytes_over_baseline"
        ]
        == 512
    )
    assert (
        timeline_from_snapshot(snapshot, 1, marks, baseline_bytes=0, stopped_us=0)[
            "peak_bytes_over_baseline"
        ]
        == 1 << 30
    )


def test_a_full_ring_is_anchored_at_the_end() -> None:
    trace = Trace()
    for _ in range(4):
        trace.alloc(512)
    marks = [(RECORDING, trace.entries[0]["time_us"])]
    timeline = timeline_from_snapshot(
        trace.snapshot(),
        0,
        marks,
        baseline_bytes=0,
        stopped_us=0,
        max_entries=4,
        allocated_end=10_000,
    )
    assert timeline["dropped_events"] is True
    assert timeline["end_bytes_over_baseline"] == 10_000
    assert timeline["points"][0][1] == 10_000 - 4 * 512


def test_empty_trace_gives_a_flat_timeline() -> None:
    timeline = timeline_from_snapshot(
        {"device_traces": [[]]}, 0, [], baseline_bytes=7, stopped_us=0
    )
    assert timeline["points"] == [[0.0, 0]] and timeline["peak_bytes_over_baseline"] == 0
    with pytest.raises((KeyError, IndexError)):
        timeline_from_snapshot({}, 0, [], baseline_bytes=0, stopped_us=0)


def test_downsampling_keeps_bucket_extremes_and_the_peak() -> None:
    points = [(i / 1000, (i * 7919) % 1000) for i in range(10_000)]
    points[5_555] = (5.555, 5_000)
    kept = downsample(points, 300)
    assert len(kept) <= 310 and kept[0] == points[0] and kept[-1] == points[-1]
    assert (5.555, 5_000) in kept
    assert [t for t, _ in kept] == sorted(t for t, _ in kept)
    assert downsample(points[:10], 300) == points[:10]
    assert downsample([(0.0, 1), (0.0, 2), (0.0, 0)] * 200, 30)


def test_a_long_trace_is_downsampled_in_the_result() -> None:
    trace = Trace()
    addresses = [trace.alloc(512 * (1 + i % 7)) for i in range(5000)]
    marks = [(RECORDING, trace.entries[0]["time_us"])]
    timeline = timeline_from_snapshot(
        trace.snapshot(), 0, marks, baseline_bytes=0, stopped_us=0, max_points=600
    )
    assert timeline["points_before_downsampling"] == len(addresses) + 1
    assert len(timeline["points"]) <= 610
    assert timeline["peak_bytes_over_baseline"] == max(v for _, v in timeline["points"])


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
    timeline = recorded_resume()
    assert timeline_problems(timeline) == []
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
    upstream = recorded_resume(scaffold_bytes_per_param=12, seconds=5.0)
    build = recorded_resume(scaffold_bytes_per_param=4, seconds=4.0)
    return {"upstream": upstream, "build": build}


def _run(name: str, sides: dict[str, Any], params: int = 50_000_000) -> dict[str, Any]:
    """A run document of the benchmark (:mod:`.megatron_lm`) whose resumes carry ``sides``."""
    phases: dict[str, Any] = {"uninterrupted": {"parameters": params, "load": None}}
    for label, timeline in sides.items():
        phases[f"resume-{label}"] = {"load": {"baseline_bytes": 1, "memory_timeline": timeline}}
    return {"configuration": {"name": name}, "phases": phases}


def _document(sides: dict[str, Any]) -> dict[str, Any]:
    return {"runs": [_run("dp-reshardable", sides), _run("moe", {}), {"phases": {}}]}


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


def test_figure_without_phases_has_no_strip(figures: Any, tmp_path: Path) -> None:
    sides = {label: {**t, "phases": []} for label, t in _two_sides().items()}
    unphased = figures.CaseTimelines("dp-reshardable", sides, params=50_000_000)
    phased = figures.CaseTimelines("dp-reshardable", _two_sides(), params=50_000_000)
    plain = figures.render_case_figure(unphased, tmp_path / "plain.png")
    with_bars = figures.render_case_figure(phased, tmp_path / "bars.png")
    assert _png_size(plain) == _png_size(with_bars)
    assert plain.read_bytes() != with_bars.read_bytes()


def test_figure_with_one_side_and_no_parameter_count(figures: Any, tmp_path: Path) -> None:
    timeline = recorded_resume(scaffold_bytes_per_param=4)
    timelines = figures.CaseTimelines("moe", {"build": timeline, "broken": {"unit": "?"}})
    path = figures.render_case_figure(timelines, tmp_path / "moe.png")
    assert _png_size(path)[0] > 0
    with pytest.raises(ValueError, match="no usable timeline"):
        figures.render_case_figure(figures.CaseTimelines("x", {"a": {}}), tmp_path / "x.png")


def test_runs_with_timelines_are_found(figures: Any) -> None:
    found = figures.case_timelines(_document(_two_sides()))
    assert [(c.case, c.params, list(c.sides)) for c in found] == [
        ("dp-reshardable", 50_000_000, ["upstream", "build"])
    ]
    assert figures.figure_name(figures.CaseTimelines("your arguments", {})) == "your_arguments.png"
    # A single run of the client (docs/gpu-results/megatron-lm-1b) is its own document.
    (single,) = figures.case_timelines(_run("megatron-lm", _two_sides()) | {"configuration": {}})
    assert single.case == "megatron-lm"


def test_cli_writes_one_png_per_run_and_markdown(figures: Any, tmp_path: Path) -> None:
    sides = _two_sides()
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(_document(sides)))
    second.write_text(json.dumps({"runs": [*_document(sides)["runs"], _run("precision-aware", sides)]}))
    out = tmp_path / "report" / "figures"
    markdown = tmp_path / "report" / "figures.md"
    status = figures.main(
        [str(first), str(second), "--out-dir", str(out), "--markdown-out", str(markdown)]
    )
    assert status == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["dp-reshardable-2.png", "dp-reshardable.png", "precision-aware.png"]
    lines = [line for line in markdown.read_text().splitlines() if line]
    assert lines == [
        "![dp-reshardable: allocated GPU memory during the resume](figures/dp-reshardable.png)",
        "![dp-reshardable: allocated GPU memory during the resume](figures/dp-reshardable-2.png)",
        "![precision-aware: allocated GPU memory during the resume](figures/precision-aware.png)",
    ]
    nothing = tmp_path / "c.json"
    nothing.write_text(json.dumps({"runs": [_run("moe", {})]}))
    assert figures.main([str(nothing), "--out-dir", str(tmp_path / "only")]) == 1


def test_a_failed_recording_is_noted_not_drawn(figures: Any, tmp_path: Path) -> None:
    sides = _two_sides()
    document = _document({"upstream": sides["upstream"], "build": {"error": "RuntimeError: x"}})
    (found,) = figures.case_timelines(document)
    assert list(found.sides) == ["upstream"]
    assert found.notes == ("build: no timeline (RuntimeError: x)",)
    nothing = _document({"build": {"error": "RuntimeError: x"}})
    assert figures.write_figures([nothing], tmp_path) == []
    written = figures.write_figures([document], tmp_path)
    assert [p.name for _, p in written] == ["dp-reshardable.png"]


def test_memory_timeline_imports_neither_torch_nor_matplotlib() -> None:
    code = (
        "import sys, benchmarks.resume_benchmark.memory_timeline; "
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


def test_torch_profilers_categories_do_not_name_state_a_load_allocates() -> None:
    """Why the timeline does not use torch.profiler's categorised memory timeline: it names
    optimizer state from ``Optimizer.step``'s dataflow, so the moments a step creates are
    "optimizer state" but the copies a ``load_state_dict`` allocates (where TE's duplicate
    lives) stay uncategorised. Real torch, on the CPU."""
    import copy

    import torch
    from torch.profiler import ProfilerActivity, profile

    memory_profiler = pytest.importorskip("torch.profiler._memory_profiler")
    model = torch.nn.Linear(256, 256)
    trained = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    trained.step()
    saved = copy.deepcopy(trained.state_dict())
    activities = [ProfilerActivity.CPU]
    with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as p:
        stepped = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 256)).sum().backward()
        stepped.step()  # creates its moments inside the step
        torch.optim.Adam(model.parameters()).load_state_dict(copy.deepcopy(saved))
    profile_ = memory_profiler.MemoryProfile(p.profiler.kineto_results)
    created: dict[str, int] = {}
    for _, action, (key, version), size in profile_.timeline:
        if action.name == "CREATE":
            category = str(profile_._categories.get(key, version))
            created[category] = created.get(category, 0) + size
    moments = 2 * 4 * (256 * 256 + 256)
    assert created["Category.OPTIMIZER_STATE"] >= moments
    assert created["None"] >= moments  # the loaded copies: not optimizer state
