"""Ordered, thread-safe registry of state adopters.

Adopters are registered in code with :func:`register_state_adopter` or, for installed
plugin packages, discovered from the entry-point group :data:`ENTRY_POINT_GROUP`. Each
entry point names a zero-argument callable (typically the adopter class) that returns an
adopter, e.g. in the plugin's ``pyproject.toml``::

    [project.entry-points."megatron_core.optimizer_state_adopters"]
    my_adam = "my_package.adoption:MyAdamStateAdopter"

Entry-point adopters are loaded once, on first use, after the built-in ones.
"""

import logging
import threading
from collections import OrderedDict
from importlib.metadata import entry_points
from typing import Optional, Tuple

from torch.utils.hooks import RemovableHandle

from .adopter import StateAdopter

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "megatron_core.optimizer_state_adopters"


def _check_is_adopter(adopter: object) -> None:
    """Raise ``TypeError`` unless ``adopter`` implements :class:`StateAdopter`."""
    if not isinstance(adopter, StateAdopter) or isinstance(adopter, type):
        raise TypeError(
            f"{adopter!r} is not a state adopter: it needs a 'name' and the methods "
            "'decline_reason(context)' and 'adopt(context)'"
        )
    if not isinstance(adopter.name, str) or not adopter.name:
        raise TypeError(f"state adopter {adopter!r} needs a non-empty string 'name'")


class _AdopterDict(OrderedDict[int, StateAdopter]):
    """Adopters by handle id; removal through a ``RemovableHandle`` takes the lock."""

    def __init__(self, lock: threading.RLock) -> None:
        super().__init__()
        self._lock = lock

    def __delitem__(self, handle_id: int) -> None:
        with self._lock:
            super().__delitem__(handle_id)


class StateAdopterRegistry:
    """An ordered collection of state adopters; the first adopter that accepts wins.

    Args:
        entry_point_group (str, optional): entry-point group to discover plugin adopters
            from on first use; None disables discovery.
    """

    def __init__(self, entry_point_group: Optional[str] = ENTRY_POINT_GROUP) -> None:
        self._lock = threading.RLock()
        self._adopters = _AdopterDict(self._lock)
        self._entry_point_group = entry_point_group
        self._entry_points_loaded = entry_point_group is None

    def register(self, adopter: StateAdopter, prepend: bool = False) -> RemovableHandle:
        """Register ``adopter``; it is tried after (or, with ``prepend``, before) the others.

        Args:
            adopter (StateAdopter): the adopter to register.
            prepend (bool): if True, try this adopter before all registered ones.

        Returns:
            torch.utils.hooks.RemovableHandle: ``handle.remove()`` unregisters it.
        """
        _check_is_adopter(adopter)
        with self._lock:
            handle = RemovableHandle(self._adopters)
            self._adopters[handle.id] = adopter
            if prepend:
                self._adopters.move_to_end(handle.id, last=False)
        return handle

    def adopters(self) -> Tuple[StateAdopter, ...]:
        """Return the registered adopters in the order they are tried.

        Returns:
            Tuple[StateAdopter, ...]: a snapshot; later registrations do not change it.
        """
        self._load_entry_points_once()
        with self._lock:
            return tuple(self._adopters.values())

    def _load_entry_points_once(self) -> None:
        """Register the adopters of installed plugins; a broken plugin is logged and skipped."""
        with self._lock:
            if self._entry_points_loaded:
                return
            self._entry_points_loaded = True
            assert self._entry_point_group is not None
            for entry_point in sorted(
                entry_points(group=self._entry_point_group), key=lambda ep: ep.name
            ):
                try:
                    adopter = entry_point.load()()
                    self.register(adopter)
                except Exception as error:  # a plugin must never break checkpoint loading
                    logger.warning(
                        "Skipping optimizer state adopter plugin %r (%s): %s: %s",
                        entry_point.name,
                        entry_point.value,
                        type(error).__name__,
                        error,
                    )


_DEFAULT_REGISTRY = StateAdopterRegistry()


def default_registry() -> StateAdopterRegistry:
    """Return the process-wide registry that ``DistributedOptimizer`` consults."""
    return _DEFAULT_REGISTRY


def register_state_adopter(adopter: StateAdopter, prepend: bool = False) -> RemovableHandle:
    """Register ``adopter`` in the process-wide registry.

    Args:
        adopter (StateAdopter): the adopter to register.
        prepend (bool): if True, try this adopter before all registered ones.

    Returns:
        torch.utils.hooks.RemovableHandle: ``handle.remove()`` unregisters it.
    """
    return _DEFAULT_REGISTRY.register(adopter, prepend=prepend)


def registered_state_adopters() -> Tuple[StateAdopter, ...]:
    """Return the process-wide registry's adopters in the order they are tried."""
    return _DEFAULT_REGISTRY.adopters()
