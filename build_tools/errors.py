"""Errors raised while fetching, checking and composing the wheel, and how a build refuses."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final, TextIO

#: Width of the framed refusal, borders included.
REFUSAL_WIDTH: Final = 78

#: What the framed refusal starts with.
REFUSAL_TITLE: Final = "megatron-core build refused:"


class ComposeError(RuntimeError):
    """Base class of every error raised by the wheel composition."""


class ToolMissingError(ComposeError):
    """A required external tool (GNU patch, pip, the ``wheel`` package) is unavailable."""


class UpstreamFetchError(ComposeError):
    """The upstream wheel could not be fetched or located."""


class HashMismatchError(ComposeError):
    """A file's sha256 differs from the pinned one, or no hash is pinned for it."""


class OverlayCollisionError(ComposeError):
    """A file of this repository would overwrite a file that upstream ships."""


class PatchError(ComposeError):
    """A patch does not apply cleanly."""


class MetadataError(ComposeError):
    """The upstream wheel's metadata has a shape this build cannot handle."""


def framed(message: str, width: int = REFUSAL_WIDTH) -> str:
    """``message`` in a box ``width`` wide: its own line breaks kept, long lines wrapped at
    spaces; a word longer than a line (a path) widens the box rather than being split."""
    lines: list[str] = []
    for paragraph in message.splitlines() or [""]:
        lines += textwrap.wrap(
            paragraph, width - 4, break_long_words=False, break_on_hyphens=False
        ) or [""]
    inner = max(width - 4, *(len(line) for line in lines))
    border = "+" + "-" * (inner + 2) + "+"
    return "\n".join([border, *(f"| {line:<{inner}} |" for line in lines), border])


@contextmanager
def refusals_framed(stream: TextIO | None = None) -> Iterator[None]:
    """Turn a :class:`ComposeError` into one framed message on ``stream`` (stderr) and exit 1,
    without a traceback: what ``setup.py`` shows a user whose build it refuses."""
    try:
        yield
    except ComposeError as error:
        print(framed(f"{REFUSAL_TITLE}\n{error}"), file=stream or sys.stderr, flush=True)
        raise SystemExit(1) from None
