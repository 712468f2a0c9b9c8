"""Runs Megatron-LM's ``pretrain_gpt.py`` unchanged in this process and records what it did.

One rank of a ``torch.distributed.run`` launch of the Megatron-LM client (:mod:`.megatron_lm`)::

    python -m benchmarks.resume_benchmark.megatron_lm_probe --client DIR --result R.json \\
        -- pretrain_gpt.py ARGS...

The script runs as ``__main__`` with the client tree first on ``sys.path``; the probe only
observes. ``sys.monitoring`` events of Megatron-LM's ``load_checkpoint`` mark the load's start
and return, where the allocator statistics are read without resetting them (so Megatron's own
"max allocated" report is unchanged). Each rank writes ``R.rank<r>.json``::

    {"load": {"baseline_bytes", "peak_before_bytes", "peak_bytes", "end_bytes", "seconds",
              "memory_timeline"} | None,
     "max_allocated_bytes", "exit_code", "state_adoption": {"adopters", "outcomes"},
     "modules": {"megatron.core": FILE, "megatron.training": FILE}}

``load.peak_bytes`` is None when the load did not raise the process's peak;
``load.memory_timeline`` is the load's :class:`~.memory_timeline.Timeline` (no phases), or an
``{"error": ...}`` record.
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
from typing import Any

from benchmarks.resume_benchmark.driver import rank_result_path
from benchmarks.resume_benchmark.memory_timeline import (
    LoadTimeline,
    finished_timeline,
    started_timeline,
)
from benchmarks.resume_benchmark.results import (
    recording_outcomes,
    registered_adopter_names,
    write_json,
)

#: The Megatron-LM function whose allocator peak is the load peak.
LOAD_FUNCTION = ("megatron.training.checkpointing", "load_checkpoint")

_TOOL_NAME = "resume-benchmark load probe"


class LoadWatch:
    """Allocator readings at the start and return of one function (first call only)."""

    def __init__(self) -> None:
        self.record: dict[str, Any] | None = None
        self._started = 0.0
        self._timeline: LoadTimeline | dict[str, str] = {"error": "the load never began"}

    def begin(self, code: CodeType, offset: int) -> Any:
        """``PY_START``: the load begins; read the level and the peak so far."""
        import torch

        if self.record is None:
            _synchronize(torch)
            self._started = time.perf_counter()
            self.record = {
                "baseline_bytes": torch.cuda.memory_allocated(),
                "peak_before_bytes": torch.cuda.max_memory_allocated(),
            }
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
            self.record["memory_timeline"] = finished_timeline(self._timeline)
        return sys.monitoring.DISABLE


def _synchronize(torch: Any) -> None:
    """Wait for the GPU (without CUDA, as in the CPU tests, torch's statistics stay 0)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def watch_load(watch: LoadWatch) -> int:
    """Route ``PY_START``/``PY_RETURN`` of Megatron-LM's ``load_checkpoint`` to ``watch``."""
    import importlib

    module_name, function_name = LOAD_FUNCTION
    code = getattr(importlib.import_module(module_name), function_name).__code__
    events = sys.monitoring.events
    tool = sys.monitoring.PROFILER_ID
    sys.monitoring.use_tool_id(tool, _TOOL_NAME)
    sys.monitoring.register_callback(tool, events.PY_START, watch.begin)
    sys.monitoring.register_callback(tool, events.PY_RETURN, watch.end)
    sys.monitoring.set_local_events(tool, code, events.PY_START | events.PY_RETURN)
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

    watch = LoadWatch()
    tool = watch_load(watch)
    with recording_outcomes() as outcomes:
        exit_code = run_script(args.client / args.script, args.script_args)
    sys.monitoring.free_tool_id(tool)
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "load": watch.record,
        "max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "exit_code": exit_code,
        "state_adoption": {"adopters": registered_adopter_names(), "outcomes": outcomes},
        "modules": {
            name: getattr(sys.modules.get(name), "__file__", None)
            for name in ("megatron.core", "megatron.training")
        },
    }
    write_json(rank_result_path(args.result, rank), record)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
