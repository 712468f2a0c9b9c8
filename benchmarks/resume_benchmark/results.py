"""Worker result files, progress lines, and bitwise comparison of fingerprints.

Pure Python (no torch): the driver uses it on any machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Prefix of the progress lines workers print; the driver echoes these lines to its stdout.
PROGRESS_MARKER = "[resume-benchmark]"


def progress(message: str) -> None:
    """Print one timestamped progress line (flushed)."""
    stamp = time.strftime("%H:%M:%S")
    print(f"{PROGRESS_MARKER} {stamp} {message}", flush=True)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (temporary file + rename)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from ``path``."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def one_line(exc: BaseException) -> str:
    """``ExceptionType: message`` on a single line (for tables and JSON)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(frozen=True)
class DigestComparison:
    """Result of comparing two fingerprints name by name."""

    equal: bool
    compared: int
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def to_json(self, limit: int = 20) -> dict[str, Any]:
        """Summary for the JSON report (at most ``limit`` names per list)."""
        return {
            "equal": self.equal,
            "compared": self.compared,
            "mismatched_count": len(self.mismatched),
            "mismatched": self.mismatched[:limit],
            "missing": self.missing[:limit],
            "unexpected": self.unexpected[:limit],
        }


def compare_digests(expected: Mapping[str, str], actual: Mapping[str, str]) -> DigestComparison:
    """Compare two fingerprints: equal when the same names map to the same digests."""
    missing = sorted(set(expected) - set(actual))
    unexpected = sorted(set(actual) - set(expected))
    common = [name for name in expected if name in actual]
    mismatched = [name for name in common if expected[name] != actual[name]]
    equal = not missing and not unexpected and not mismatched and bool(expected)
    return DigestComparison(equal, len(common), mismatched, missing, unexpected)


def merge_rank_digests(parts: Sequence[Mapping[str, str]]) -> tuple[dict[str, str], list[str]]:
    """Union of several ranks' fingerprints, and the names whose digests differ between ranks.

    Ranks holding the same replicated shard report it under the same name; a conflict means
    replicas that should be identical are not.
    """
    merged: dict[str, str] = {}
    conflicts: set[str] = set()
    for part in parts:
        for name, digest in part.items():
            if merged.setdefault(name, digest) != digest:
                conflicts.add(name)
    return merged, sorted(conflicts)


def eprint(message: str) -> None:
    """Print to stderr (flushed)."""
    print(message, file=sys.stderr, flush=True)
