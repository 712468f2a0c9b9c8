"""Turn a wheel's core metadata into setuptools' ``install_requires``/``extras_require``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from email.parser import Parser
from email.policy import compat32
from typing import Final

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement

from .errors import MetadataError

_EXTRA_ONLY: Final = re.compile(r'^extra == "(?P<extra>[^"]+)"$')
_COND_AND_EXTRA: Final = re.compile(r'^(?P<cond>.+) and extra == "(?P<extra>[^"]+)"$')


@dataclass(frozen=True)
class Requirements:
    """What ``setup()`` needs to reproduce a wheel's dependency metadata."""

    python_requires: str | None
    install_requires: list[str] = field(default_factory=list)
    extras_require: dict[str, list[str]] = field(default_factory=dict)


def _has_top_level_or(marker: str) -> bool:
    """Return True if ``marker`` has an ``or`` outside parentheses and quoted strings."""
    depth = 0
    quote: str | None = None
    for index, char in enumerate(marker):
        if quote is not None:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif depth == 0 and marker.startswith(" or ", index):
            return True
    return False


def _split_extra(marker: str, line: str) -> tuple[str | None, str | None]:
    """Split a marker into (remaining condition, extra name); raise if the shape is unknown."""
    if "extra" not in marker:
        return marker, None
    if match := _EXTRA_ONLY.match(marker):
        return None, match["extra"]
    match = _COND_AND_EXTRA.match(marker)
    if match is None or "extra" in match["cond"] or _has_top_level_or(match["cond"]):
        raise MetadataError(f"cannot convert the marker of Requires-Dist: {line}")
    return match["cond"], match["extra"]


def _convert(line: str) -> tuple[str, str | None]:
    """Return (PEP 508 string without the extra clause, extra name or None) for one line."""
    try:
        requirement = Requirement(line)
    except InvalidRequirement as error:
        raise MetadataError(f"invalid Requires-Dist: {line}: {error}") from error
    extra: str | None = None
    if requirement.marker is not None:
        condition, extra = _split_extra(str(requirement.marker), line)
        requirement.marker = None if condition is None else Marker(condition)
    return str(requirement), extra


def requirements_from_metadata(metadata_text: str) -> Requirements:
    """Derive python_requires, install_requires and extras_require from a METADATA text."""
    message = Parser(policy=compat32).parsestr(metadata_text, headersonly=True)
    install_requires: list[str] = []
    extras: dict[str, list[str]] = {
        name.strip(): [] for name in message.get_all("Provides-Extra", [])
    }
    for line in message.get_all("Requires-Dist", []):
        spec, extra = _convert(line.strip())
        if extra is None:
            install_requires.append(spec)
        elif extra not in extras:
            raise MetadataError(f"Requires-Dist names undeclared extra {extra!r}: {line}")
        else:
            extras[extra].append(spec)
    python_requires = message.get("Requires-Python")
    return Requirements(
        python_requires=None if python_requires is None else python_requires.strip(),
        install_requires=install_requires,
        extras_require=extras,
    )
