"""Ordered, thread-safe registry of state adopters with unique names.

Adopters are registered in code with :func:`register_state_adopter` or, for installed
plugin packages, discovered from the entry-point group
``megatron_core.optimizer_state_adopters``. Each entry point names a zero-argument callable
(typically the adopter class) that returns an adopter, e.g. in the plugin's
``pyproject.toml``::

    [project.entry-points."megatron_core.optimizer_state_adopters"]
    my_adam = "my_package.adoption:MyAdamStateAdopter"

Entry-point adopters are loaded once, on first use, after the built-in ones, in entry-point
name order. :func:`registered_state_adopters` lists every adopter with where it came from
and a handle that removes it, whichever way it was registered.
"""

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Optional, Tuple, TypeVar

from torch.utils.hooks import RemovableHandle

from .adopter import StateAdopter

__all__ = ["StateAdopterRegistration", "register_state_adopter", "registered_state_adopters"]

logger = logging.getLogger(__name__)

_ENTRY_POINT_GROUP = "megatron_core.optimizer_state_adopters"

_T = TypeVar("_T")


class _LockedHandleDict(OrderedDict[int, _T]):
    """Hooks by handle id; removal through a ``RemovableHandle`` takes the owner's lock."""

    def __init__(self, lock: threading.RLock) -> None:
        super().__init__()
        self._lock = lock

    def __delitem__(self, handle_id: int) -> None:
        with self._lock:
            super().__delitem__(handle_id)


@dataclass(frozen=True)
class StateAdopterRegistration:
    """One registered adopter.

    Attributes:
        name (str): the adopter's name, unique in the registry.
        adopter (StateAdopter): the adopter.
        origin (str): where it came from: ``"built-in"``, ``"register_state_adopter"`` or
            ``"entry point NAME = VALUE (DISTRIBUTION VERSION)"``.
        handle (RemovableHandle): ``handle.remove()`` unregisters it.
    """

    name: str
    adopter: StateAdopter
    origin: str
    handle: RemovableHandle


def _check_is_adopter(adopter: object) -> None:
    """Raise ``TypeError`` unless ``adopter`` implements :class:`StateAdopter`."""
    if not isinstance(adopter, StateAdopter) or isinstance(adopter, type):
        raise TypeError(
            f"{adopter!r} is not a state adopter: it needs a 'name' and the methods "
            "'decline_reason(context)' and 'adopt(context)'"
        )
    if not isinstance(adopter.name, str) or not adopter.name.strip() or "," in adopter.name:
        raise TypeError(f"state adopter {adopter!r} needs a non-empty string 'name' without commas")


def _entry_point_origin(entry_point: EntryPoint) -> str:
    """Describe an entry point and the distribution that declares it."""
    distribution = getattr(entry_point, "dist", None)
    declared_by = f" ({distribution.name} {distribution.version})" if distribution else ""
    return f"entry point {entry_point.name} = {entry_point.value}{declared_by}"


class _StateAdopterRegistry:
    """An ordered collection of uniquely named state adopters; the first that accepts wins.

    Args:
        entry_point_group (str, optional): entry-point group to discover plugin adopters
            from on first use; None disables discovery.
    """

    def __init__(self, entry_point_group: Optional[str] = _ENTRY_POINT_GROUP) -> None:
        self._lock = threading.RLock()
        self._registrations: _LockedHandleDict[StateAdopterRegistration] = _LockedHandleDict(
            self._lock
        )
        self._entry_point_group = entry_point_group
        self._entry_points_loaded = entry_point_group is None

    def register(
        self, adopter: StateAdopter, prepend: bool = False, origin: str = "register_state_adopter"
    ) -> RemovableHandle:
        """Register ``adopter``; it is tried after (or, with ``prepend``, before) the others.

        Args:
            adopter (StateAdopter): the adopter to register.
            prepend (bool): if True, try this adopter before all registered ones.
            origin (str): where the adopter comes from, as listed by :meth:`registrations`.

        Returns:
            torch.utils.hooks.RemovableHandle: ``handle.remove()`` unregisters it.

        Raises:
            TypeError: if ``adopter`` is not a :class:`StateAdopter`.
            ValueError: if an adopter with the same name is registered.
        """
        _check_is_adopter(adopter)
        name = adopter.name
        with self._lock:
            for registration in self._registrations.values():
                if registration.name == name:
                    raise ValueError(
                        f"a state adopter named {name!r} is already registered "
                        f"({registration.origin}); remove it first or choose another name"
                    )
            handle = RemovableHandle(self._registrations)
            self._registrations[handle.id] = StateAdopterRegistration(name, adopter, origin, handle)
            if prepend:
                self._registrations.move_to_end(handle.id, last=False)
        return handle

    def registrations(self) -> Tuple[StateAdopterRegistration, ...]:
        """Return the registrations in the order their adopters are tried.

        Returns:
            Tuple[StateAdopterRegistration, ...]: a snapshot; later changes do not alter it.
        """
        self._load_entry_points_once()
        with self._lock:
            return tuple(self._registrations.values())

    def _load_entry_points_once(self) -> None:
        """Register installed plugins' adopters; a broken or colliding one is logged and skipped."""
        with self._lock:
            if self._entry_points_loaded:
                return
            self._entry_points_loaded = True
            assert self._entry_point_group is not None
            for entry_point in sorted(
                entry_points(group=self._entry_point_group), key=lambda ep: ep.name
            ):
                origin = _entry_point_origin(entry_point)
                try:
                    self.register(entry_point.load()(), origin=origin)
                except Exception as error:  # a plugin must never break checkpoint loading
                    logger.warning(
                        "Skipping optimizer state adopter plugin from %s: %s: %s",
                        origin,
                        type(error).__name__,
                        error,
                    )


_DEFAULT_REGISTRY = _StateAdopterRegistry()


def register_state_adopter(adopter: StateAdopter, prepend: bool = False) -> RemovableHandle:
    """Register ``adopter`` in the process-wide registry that ``DistributedOptimizer`` consults.

    Args:
        adopter (StateAdopter): the adopter to register; its ``name`` must be unused.
        prepend (bool): if True, try this adopter before all registered ones.

    Returns:
        torch.utils.hooks.RemovableHandle: ``handle.remove()`` unregisters it.

    Raises:
        TypeError: if ``adopter`` is not a :class:`StateAdopter`.
        ValueError: if an adopter with the same name is registered.
    """
    return _DEFAULT_REGISTRY.register(adopter, prepend=prepend)


def registered_state_adopters() -> Tuple[StateAdopterRegistration, ...]:
    """Return the process-wide registry's adopters in the order they are tried.

    Returns:
        Tuple[StateAdopterRegistration, ...]: each adopter with its name, origin and a handle
        that removes it (entry-point adopters included).
    """
    return _DEFAULT_REGISTRY.registrations()
