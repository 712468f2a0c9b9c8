"""Errors raised while fetching, checking and composing the wheel."""

from __future__ import annotations


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
