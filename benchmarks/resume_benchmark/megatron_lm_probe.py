"""Runs Megatron-LM's ``pretrain_gpt.py`` unchanged in this process and records what it did.

One rank of a ``torch.distributed.run`` launch of the Megatron-LM client (:mod:`.megatron_lm`)::

    python -m benchmarks.resume_benchmark.megatron_lm_probe --client DIR --result R.json \\
        -- pretrain_gpt.py ARGS...

The script runs as ``__main__`` with the client tree first on ``sys.path``; the probe only
observes. ``sys.monitoring`` events of Megatron-LM's ``load_checkpoint`` mark the load's start
and return, where the allocator statistics are read without resetting them (so Megatron's own
"max allocated" report is unchanged); ``PY_START`` of the functions in
:data:`PHASE_FUNCTIONS` opens the load's phases. Each rank writes ``R.rank<r>.json``::

    {"load": {"baseline_bytes", "peak_before_bytes", "peak_bytes", "end_bytes", "seconds",
              "phases": [[phase, seconds since the load began], ...], "memory_timeline"} | None,
     "max_allocated_bytes", "exit_code", "state_adoption": {"adopters", "outcomes"},
     "modules": {"megatron.core": FILE, "megatron.training": FILE}}

``load.peak_bytes`` is None when the load did not raise the process's peak;
``load.memory_timeline`` is the load's :class:`~.memory_timeline.Timeline` (with those
phases), or an ``{"error": ...}`` record.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import CodeType
from typing import Any, Final, TypedDict

from benchmarks.resume_benchmark.driver import rank_result_path
from benchmarks.resume_benchmark.memory_timeline import (
    LOAD_PHASES,
    PHASE_MODEL,
    PHASE_PAYLOAD,
    PHASE_READ,
    PHASE_SCAFFOLD,
    LoadTimeline,
    Timeline,
    finished_timeline,
    started_timeline,
)
from benchmarks.resume_benchmark.results import (
    AdoptionRecord,
    recording_outcomes,
    registered_adopter_names,
    write_json,
)

#: The Megatron-LM function whose allocator peak is the load peak.
LOAD_FUNCTION = ("megatron.training.checkpointing", "load_checkpoint")

#: Functions whose first call inside the load opens a phase of its timeline (module, qualified
#: name, phase): the optimizers' sharded state dict (pass 1, the scaffold the checkpoint is read
#: into), the read, the model's ``load_state_dict`` and the optimizers' (pass 2). Phases open in
#: the order of :data:`~.memory_timeline.LOAD_PHASES` only, so pass 1's own ``load_state_dict``
#: call opens nothing.
PHASE_FUNCTIONS: Final = tuple(
    (module, f"{owner}.{method}", phase)
    for module, owners in (
        ("megatron.core.optimizer.distrib_optimizer", ("DistributedOptimizer",)),
        (
            "megatron.core.optimizer.optimizer",
            ("Float16OptimizerWithFloat16Params", "FP32Optimizer"),
        ),
    )
    for owner in owners
    for method, phase in (
        ("sharded_state_dict", PHASE_SCAFFOLD),
        ("load_state_dict", PHASE_PAYLOAD),
    )
) + (
    ("megatron.core.dist_checkpointing.serialization", "load", PHASE_READ),
    ("torch.nn.modules.module", "Module.load_state_dict", PHASE_MODEL),
)

_TOOL_NAME = "resume-benchmark load probe"


class LoadRecord(TypedDict, total=False):
    """The allocator around one load (see the module docstring)."""

    baseline_bytes: int
    peak_before_bytes: int
    peak_bytes: int | None
    end_bytes: int
    seconds: float
    phases: list[tuple[str, float]]
    memory_timeline: Timeline | dict[str, str]


class RankRecord(TypedDict):
    """What one rank writes (see the module docstring)."""

    load: LoadRecord | None
    max_allocated_bytes: int
    exit_code: int
    state_adoption: AdoptionRecord
    modules: dict[str, str | None]


class LoadWatch:
    """Allocator readings at the start and return of one function (first call only)."""

    def __init__(self, phases: dict[CodeType, str] | None = None) -> None:
        self.record: LoadRecord | None = None
        self._started = 0.0
        self._timeline: LoadTimeline | dict[str, str] = {"error": "the load never began"}
        self._phases = phases or {}
        self.opened: list[tuple[str, float]] = []

    def start(self, code: CodeType, offset: int) -> Any:
        """``PY_START`` of a watched function: the load's start, or a phase of it."""
        if code not in self._phases:
            return self.begin(code, offset)
        if self.record is None or "end_bytes" in self.record:
            return None if self.record is None else sys.monitoring.DISABLE
        phase = self._phases[code]
        if self.phase_opens(phase):
            self.opened.append((phase, time.perf_counter() - self._started))
            if isinstance(self._timeline, LoadTimeline):
                self._timeline.mark(phase)
        return sys.monitoring.DISABLE if any(p == phase for p, _ in self.opened) else None

    def phase_opens(self, phase: str) -> bool:
        """Whether ``phase`` opens now: later in :data:`~.memory_timeline.LOAD_PHASES` than every
        opened one, and the model and pass 2 only once the read began."""
        done = [LOAD_PHASES.index(p) for p, _ in self.opened]
        index = LOAD_PHASES.index(phase)
        after_read = index <= 1 or LOAD_PHASES.index(PHASE_READ) in done
        return after_read and all(index > d for d in done)

    def begin(self, code: CodeType, offset: int) -> Any:
        """``PY_START``: the load begins; read the level and the peak so far."""
        import torch

        if self.record is None:
            _synchronize(torch)
            self._started = time.perf_counter()
            self.record = LoadRecord(
                baseline_bytes=torch.cuda.memory_allocated(),
                peak_before_bytes=torch.cuda.max_memory_allocated(),
            )
            self._timeline = started_timeline(self.record["baseline_bytes"])
        return sys.monitoring.DISABLE

    def end(self, code: CodeType, offset: int, value: Any) -> Any:
        """``PY_RETURN``: the load returned; its peak is the new process peak, if it rose."""
        import torch

        if self.record is not None and "end_bytes" not in self.record:
            _synchronize(torch)
            seconds = time.perf_counter() - self._started
            peak = torch.cuda.max_memory_allocated()
            self.record["peak_bytes"] = peak if peak > self.record["peak_before_bytes"] else None
            self.record["end_bytes"] = torch.cuda.memory_allocated()
            self.record["seconds"] = seconds
            self.record["phases"] = [(label, round(t, 6)) for label, t in self.opened]
            self.record["memory_timeline"] = finished_timeline(self._timeline)
        return sys.monitoring.DISABLE


def _synchronize(torch: Any) -> None:
    """Wait for the GPU (without CUDA, as in the CPU tests, torch's statistics stay 0)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _code(module_name: str, qualified_name: str) -> CodeType | None:
    """The code object of ``module_name.qualified_name`` (None: not in this megatron-core)."""
    import importlib

    try:
        target: Any = importlib.import_module(module_name)
        for name in qualified_name.split("."):
            target = getattr(target, name)
        return target.__code__  # type: ignore[no-any-return]
    except (ImportError, AttributeError):
        return None


def phase_codes() -> dict[CodeType, str]:
    """The code objects of :data:`PHASE_FUNCTIONS` this process has, and their phases."""
    found = {_code(module, name): phase for module, name, phase in PHASE_FUNCTIONS}
    return {code: phase for code, phase in found.items() if code is not None}


def watch_load(watch: LoadWatch, phases: dict[CodeType, str]) -> int:
    """Route ``PY_START``/``PY_RETURN`` of Megatron-LM's ``load_checkpoint`` and ``PY_START`` of
    the ``phases`` functions to ``watch``."""
    code = _code(*LOAD_FUNCTION)
    if code is None:
        raise ImportError(f"no {'.'.join(LOAD_FUNCTION)} in the client tree")
    events = sys.monitoring.events
    tool = sys.monitoring.PROFILER_ID
    sys.monitoring.use_tool_id(tool, _TOOL_NAME)
    sys.monitoring.register_callback(tool, events.PY_START, watch.start)
    sys.monitoring.register_callback(tool, events.PY_RETURN, watch.end)
    sys.monitoring.set_local_events(tool, code, events.PY_START | events.PY_RETURN)
    for phase_code in phases:
        sys.monitoring.set_local_events(tool, phase_code, events.PY_START)
    return tool


def run_script(script: Path, script_args: Sequence[str]) -> int:
    """Run ``script`` as ``__main__`` with ``script_args``; its exit status."""
    sys.argv = [str(script), *script_args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the script under observation and write this rank's record."""
    parser = argparse.ArgumentParser(prog="megatron_lm_probe", description=__doc__)
    parser.add_argument("--client", type=Path, required=True, help="Megatron-LM client tree")
    parser.add_argument("--result", type=Path, required=True, help="result path (per rank)")
    parser.add_argument("script", type=Path)
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.client))
    import torch

    phases = phase_codes()
    watch = LoadWatch(phases)
    tool = watch_load(watch, phases)
    with recording_outcomes() as outcomes:
        exit_code = run_script(args.client / args.script, args.script_args)
    sys.monitoring.free_tool_id(tool)
    rank = int(os.environ.get("RANK", "0"))
    record = RankRecord(
        load=watch.record,
        max_allocated_bytes=torch.cuda.max_memory_allocated(),
        exit_code=exit_code,
        state_adoption=AdoptionRecord(adopters=registered_adopter_names(), outcomes=outcomes),
        modules={
            name: getattr(sys.modules.get(name), "__file__", None)
            for name in ("megatron.core", "megatron.training")
        },
    )
    write_json(rank_result_path(args.result, rank), dict(record))
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
