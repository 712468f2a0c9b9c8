"""The ordered registry of state adopters, their plugins and the outcome hooks.

Adopters are tried in this order: the built-in ones, the plugins (by entry-point name), those
registered in code; ``prepend=True`` puts one before all, the latest first, as in PyTorch's
``register_*_hook``. Megatron-Core loads the plugins once, when it constructs an optimizer: each
entry point names a zero-argument callable returning an adopter of the entry point's ``name``::

    [project.entry-points."megatron_core.optimizer_state_adopters"]
    my_adam = "my_package.adoption:MyAdamStateAdopter"
"""

import itertools
import logging
import os
import re
import threading
from dataclasses import asdict, dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Dict, Optional, Tuple

from torch.utils.hooks import RemovableHandle

from .adopter import StateAdopter

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "megatron_core.optimizer_state_adopters"
SWITCH_VARIABLE = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*")
_PREPENDED, _BUILT_IN, _PLUGIN, _CODE = range(4)


@dataclass(frozen=True)
class AdoptionOutcome:
    """What one call at a hook point (``"load"``, ``"export"``, ``"initialize"``, ``"read"``)
    did to an inner optimizer (e.g. ``"FusedAdam 0x7f3a2c1b (40 params, 52,428,800 elements)"``):
    the ``adopter`` that handled it or the own ``method`` that ran and why (``fallback_reason``),
    the ``declines`` (adopter, reason) before, the ``error`` that ended it (re-raised unchanged).
    ``reused_bytes``/``allocated_bytes``: the resulting state in storage that existed before the
    call (installed by reference) or that it created, measured, each storage once; per call (the
    two loads of one resume do not add up)."""

    hook_point: str
    optimizer: str
    adopter: Optional[str]
    method: Optional[str] = None
    reused_bytes: int = 0
    allocated_bytes: int = 0
    declines: Tuple[Tuple[str, str], ...] = ()
    fallback_reason: Optional[str] = None
    error: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        """Return the outcome as a JSON-ready dict (``declines`` as a list of pairs)."""
        record = asdict(self)
        record["declines"] = [list(decline) for decline in self.declines]
        return record


class _Handles(Dict[int, Any]):
    """Entries by handle id; a handle's removal takes the registry's lock and may be repeated."""

    def __init__(self, lock: threading.RLock) -> None:
        super().__init__()
        self._lock = lock

    def __delitem__(self, handle_id: int) -> None:
        with self._lock:
            self.pop(handle_id, None)


@dataclass(frozen=True)
class _Entry:
    item: Any  # a StateAdopter, or an outcome hook
    order: Tuple[int, Any]
    handle: RemovableHandle


class StateAdopterRegistry:
    """Uniquely named state adopters tried in order, and the hooks told of every outcome.

    Args:
        strict (bool): every fallback (an adopter that raises or whose result does not match, a
            plugin that does not load, an outcome hook that raises) raises ``RuntimeError``
            instead of being logged as a warning. Tests run strict.
        plugin_group (str, optional): the entry-point group :meth:`load_plugins` reads.
        switched_off (str, optional): why adoption is off for every optimizer, if it is.
    """

    def __init__(
        self,
        *,
        strict: bool = False,
        plugin_group: Optional[str] = None,
        switched_off: Optional[str] = None,
    ) -> None:
        self.strict, self.switched_off = strict, switched_off
        self._plugin_group = plugin_group
        self._lock, self._plugins_lock = threading.RLock(), threading.Lock()
        self._adopters, self._outcome_hooks = _Handles(self._lock), _Handles(self._lock)
        self._sequence = itertools.count()

    def register(
        self, adopter: StateAdopter, prepend: bool = False, *, built_in: bool = False
    ) -> RemovableHandle:
        """Register ``adopter`` after the others of its kind (``built_in``: Megatron-Core's own,
        before plugins), or with ``prepend`` before all; ``handle.remove()`` unregisters it.
        Raises ``TypeError`` for no ``StateAdopter`` or an invalid name, ``ValueError`` for a
        taken one."""
        return self._add(adopter, _PREPENDED if prepend else _BUILT_IN if built_in else _CODE)

    def registrations(self) -> Tuple[Tuple[StateAdopter, RemovableHandle], ...]:
        """(adopter, handle) of every registered adopter, in the order they are tried."""
        return tuple((entry.item, entry.handle) for entry in self._sorted(self._adopters))

    def register_outcome_hook(
        self, hook: Callable[[AdoptionOutcome], None], prepend: bool = False
    ) -> RemovableHandle:
        """Call ``hook(outcome)`` on this rank after every call that consults this registry;
        ``handle.remove()`` unregisters it."""
        if not callable(hook):
            raise TypeError(f"outcome hook {hook!r} is not callable")
        order = (_PREPENDED, -next(self._sequence)) if prepend else (_CODE, next(self._sequence))
        with self._lock:
            handle = RemovableHandle(self._outcome_hooks)
            self._outcome_hooks[handle.id] = _Entry(hook, order, handle)
        return handle

    def report(self, outcome: AdoptionOutcome) -> None:
        """Hand ``outcome`` to every outcome hook; one that raises is a fallback, skipped."""
        for entry in self._sorted(self._outcome_hooks):
            try:
                entry.item(outcome)
            except Exception as error:  # observing a load must not break it
                self.fall_back(f"outcome hook {entry.item!r} raised", error, "it is skipped")

    def fall_back(
        self, what: str, error: Optional[BaseException] = None, instead: str = ""
    ) -> None:
        """Log that ``what`` failed, and what runs ``instead``, as a warning on this rank; if
        strict, raise ``RuntimeError`` (nothing runs instead)."""
        what = f"Optimizer state adoption: {what}"
        cause = f" ({type(error).__name__}: {error})" if error is not None else ""
        if self.strict:
            raise RuntimeError(f"{what}{cause} [strict registry]") from error
        logger.warning(f"{what}{'; ' + instead if instead else ''}{cause}")

    def load_plugins(self) -> None:
        """Register the installed plugins' adopters, once; a broken one is a fallback."""
        with self._plugins_lock:  # a concurrent caller waits until they are registered
            group, self._plugin_group = self._plugin_group, None
            for entry_point in sorted(entry_points(group=group or ""), key=lambda ep: ep.name):
                dist = getattr(entry_point, "dist", None)
                origin = f"entry point {entry_point.name} = {entry_point.value}"
                origin += f" ({dist.name} {dist.version})" if dist is not None else ""
                try:
                    self._add(entry_point.load()(), _PLUGIN, entry_point.name)
                except Exception as error:  # a plugin must not break checkpoint loading
                    self.fall_back(f"the plugin from {origin} failed", error, "it is skipped")

    def _sorted(self, entries: Dict[int, Any]) -> Tuple[_Entry, ...]:
        with self._lock:
            return tuple(sorted(entries.values(), key=lambda entry: entry.order))

    def _add(self, adopter: StateAdopter, tier: int, key: Any = None) -> RemovableHandle:
        if not isinstance(adopter, StateAdopter):
            raise TypeError(f"{adopter!r} is not a StateAdopter")
        if not isinstance(adopter.name, str) or not _NAME.fullmatch(adopter.name):
            raise TypeError(
                f"state adopter {adopter!r} has the name {adopter.name!r}; a name starts with a "
                "letter and has only letters, digits, '_', '.' and '-'"
            )
        if tier == _PLUGIN and adopter.name != key:
            raise ValueError(f"the adopter's name {adopter.name!r} is not the entry point's")
        with self._lock:
            if any(entry.item.name == adopter.name for entry in self._adopters.values()):
                raise ValueError(f"a state adopter named {adopter.name!r} is registered")
            sequence = next(self._sequence)
            handle = RemovableHandle(self._adopters)
            order = (tier, -sequence if tier == _PREPENDED else key or sequence)
            self._adopters[handle.id] = _Entry(adopter, order, handle)
        return handle


def _switched_off_by_environment() -> Optional[str]:
    """``MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION``, read once, at import (for Megatron-LM releases
    without ``--no-optimizer-state-adoption``): it only switches off, an unknown value too.
    """
    raw = os.environ.get(SWITCH_VARIABLE, "")
    if raw.strip().lower() in ("", "0", "false", "no", "off"):
        return None
    if raw.strip().lower() not in ("1", "true", "yes", "on"):
        logger.warning(f"{SWITCH_VARIABLE}={raw!r} is none of 1, true, yes, on, 0, false, no, off")
    return f"{SWITCH_VARIABLE}={raw} is set"


_DEFAULT_REGISTRY = StateAdopterRegistry(
    plugin_group=PLUGIN_GROUP, switched_off=_switched_off_by_environment()
)


def default_registry() -> StateAdopterRegistry:
    """The process-wide registry Megatron-Core's optimizers consult."""
    return _DEFAULT_REGISTRY
