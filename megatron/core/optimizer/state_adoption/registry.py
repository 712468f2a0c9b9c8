"""Ordered, thread-safe registry of state adopters with unique names, and the outcome hooks.

Adopters are registered in code with :func:`register_state_adopter` or, for installed
plugin packages, discovered from the entry-point group
``megatron_core.optimizer_state_adopters``. Each entry point names a zero-argument callable
(typically the adopter class) that returns an adopter; the entry point's name must be the
adopter's ``name``, e.g. in the plugin's ``pyproject.toml``::

    [project.entry-points."megatron_core.optimizer_state_adopters"]
    my_adam = "my_package.adoption:MyAdamStateAdopter"   # MyAdamStateAdopter.name == "my_adam"

The order adopters are tried in does not depend on when code registers them: plugins are
discovered on the registry's first use (a registration, a listing or a load), so it is always

1. the built-in adopters,
2. the plugins, in entry-point name order,
3. the adopters registered in code, in registration order,

except that ``prepend=True`` puts an adopter before all of these (the latest first), as
PyTorch's ``register_*_hook(..., prepend=True)`` does.
"""

import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Callable, Iterable, Optional, Tuple, TypeVar

from torch.utils.hooks import RemovableHandle

from .adopter import StateAdopter
from .outcome import StateAdoptionOutcome
from .te_fused_adam import TEFusedAdamFP32StateAdopter

__all__ = [
    "StateAdopterRegistration",
    "StateAdopterRegistry",
    "default_registry",
    "register_outcome_hook",
    "register_state_adopter",
    "registered_state_adopters",
]

logger = logging.getLogger(__name__)

_ENTRY_POINT_GROUP = "megatron_core.optimizer_state_adopters"

_NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*")

_OutcomeHook = Callable[[StateAdoptionOutcome], None]

_T = TypeVar("_T")


class _LockedHandleDict(OrderedDict[int, _T]):
    """Entries by handle id; a ``RemovableHandle``'s removal takes the registry's lock too."""

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
    """Raise ``TypeError`` unless ``adopter`` implements :class:`StateAdopter` with a valid name."""
    if not isinstance(adopter, StateAdopter) or isinstance(adopter, type):
        raise TypeError(
            f"{adopter!r} is not a state adopter: it needs a 'name' and the methods "
            "'decline_reason(context)' and 'adopt(context)'"
        )
    if not isinstance(adopter.name, str) or not _NAME_PATTERN.fullmatch(adopter.name):
        raise TypeError(
            f"state adopter {adopter!r} has the name {adopter.name!r}; a name starts with a "
            "letter and has only letters, digits, '_', '.' and '-'"
        )


def _entry_point_origin(entry_point: EntryPoint) -> str:
    """Describe an entry point and the distribution that declares it."""
    distribution = getattr(entry_point, "dist", None)
    declared_by = f" ({distribution.name} {distribution.version})" if distribution else ""
    return f"entry point {entry_point.name} = {entry_point.value}{declared_by}"


class StateAdopterRegistry:
    """Uniquely named state adopters tried in order, and the hooks told of every outcome.

    The process-wide registry (:func:`default_registry`) is what ``DistributedOptimizer``
    consults. A separate one, passed as ``registry=`` to the loader functions, lets tests run
    a load with exactly the adopters they choose.

    Args:
        built_in (Iterable[StateAdopter]): adopters registered first, with origin
            ``"built-in"``.
        entry_point_group (str, optional): entry-point group to discover plugin adopters
            from on first use; None disables discovery.
    """

    def __init__(
        self,
        built_in: Iterable[StateAdopter] = (),
        entry_point_group: Optional[str] = _ENTRY_POINT_GROUP,
    ) -> None:
        self._lock = threading.RLock()
        self._registrations: _LockedHandleDict[StateAdopterRegistration] = _LockedHandleDict(
            self._lock
        )
        self._outcome_hooks: _LockedHandleDict[_OutcomeHook] = _LockedHandleDict(self._lock)
        self._entry_point_group = entry_point_group
        for adopter in built_in:
            self._add(adopter, prepend=False, origin="built-in")

    def register(self, adopter: StateAdopter, prepend: bool = False) -> RemovableHandle:
        """Register ``adopter`` after the others (or, with ``prepend``, before all of them).

        Args:
            adopter (StateAdopter): the adopter to register.
            prepend (bool): if True, try this adopter before all registered ones.

        Returns:
            torch.utils.hooks.RemovableHandle: ``handle.remove()`` unregisters it.

        Raises:
            TypeError: if ``adopter`` is not a :class:`StateAdopter` with a valid name.
            ValueError: if an adopter with the same name is registered.
        """
        self._discover_plugins()
        return self._add(adopter, prepend, origin="register_state_adopter")

    def registrations(self) -> Tuple[StateAdopterRegistration, ...]:
        """Return the registrations in the order their adopters are tried.

        Returns:
            Tuple[StateAdopterRegistration, ...]: a snapshot; later changes do not alter it.
        """
        self._discover_plugins()
        with self._lock:
            return tuple(self._registrations.values())

    def register_outcome_hook(self, hook: _OutcomeHook, prepend: bool = False) -> RemovableHandle:
        """Call ``hook(outcome)`` after every load or export through this registry.

        The hook runs on every rank, after the call. A hook that raises is logged as a
        warning and does not affect the load.

        Args:
            hook (Callable[[StateAdoptionOutcome], None]): receives each outcome.
            prepend (bool): if True, call this hook before the already registered ones.

        Returns:
            torch.utils.hooks.RemovableHandle: ``handle.remove()`` unregisters the hook.
        """
        if not callable(hook):
            raise TypeError(f"outcome hook {hook!r} is not callable")
        with self._lock:
            handle = RemovableHandle(self._outcome_hooks)
            self._outcome_hooks[handle.id] = hook
            if prepend:
                self._outcome_hooks.move_to_end(handle.id, last=False)
        return handle

    def report_outcome(self, outcome: StateAdoptionOutcome) -> None:
        """Hand ``outcome`` to every outcome hook; a hook that raises is logged and skipped.

        Args:
            outcome (StateAdoptionOutcome): what a call at a hook point did.
        """
        with self._lock:
            hooks = tuple(self._outcome_hooks.values())
        for hook in hooks:
            try:
                hook(outcome)
            except Exception as error:  # observing a load must never break it
                logger.warning(
                    "Optimizer state adoption outcome hook %r raised %s: %s",
                    hook,
                    type(error).__name__,
                    error,
                )

    def _add(self, adopter: StateAdopter, prepend: bool, origin: str) -> RemovableHandle:
        """Add one registration; the name check and the insertion are atomic."""
        _check_is_adopter(adopter)
        with self._lock:
            for registration in self._registrations.values():
                if registration.name == adopter.name:
                    raise ValueError(
                        f"a state adopter named {adopter.name!r} is already registered "
                        f"({registration.origin}); remove it first or choose another name"
                    )
            handle = RemovableHandle(self._registrations)
            self._registrations[handle.id] = StateAdopterRegistration(
                adopter.name, adopter, origin, handle
            )
            if prepend:
                self._registrations.move_to_end(handle.id, last=False)
        return handle

    def _discover_plugins(self) -> None:
        """Register installed plugins' adopters once; a broken one is logged and skipped.

        They go after the adopters registered so far, which before the first public use are
        only the built-in ones.
        """
        with self._lock:
            if self._entry_point_group is None:
                return
            group, self._entry_point_group = self._entry_point_group, None
            for entry_point in sorted(entry_points(group=group), key=lambda ep: ep.name):
                origin = _entry_point_origin(entry_point)
                try:
                    adopter = entry_point.load()()
                    name = getattr(adopter, "name", None)
                    if name != entry_point.name:
                        raise ValueError(
                            f"the adopter's name {name!r} differs from the entry point's name "
                            f"{entry_point.name!r}; they must be equal (the name disables it)"
                        )
                    self._add(adopter, prepend=False, origin=origin)
                except Exception as error:  # a plugin must never break checkpoint loading
                    logger.warning(
                        "Skipping optimizer state adopter plugin from %s: %s: %s",
                        origin,
                        type(error).__name__,
                        error,
                    )


_DEFAULT_REGISTRY = StateAdopterRegistry(built_in=(TEFusedAdamFP32StateAdopter(),))


def default_registry() -> StateAdopterRegistry:
    """Return the process-wide registry that ``DistributedOptimizer`` consults.

    Returns:
        StateAdopterRegistry: it holds the built-in adopter, the installed plugins and what
        :func:`register_state_adopter` added.
    """
    return _DEFAULT_REGISTRY


def register_state_adopter(adopter: StateAdopter, prepend: bool = False) -> RemovableHandle:
    """Register ``adopter`` in the process-wide registry (see :meth:`StateAdopterRegistry.register`).

    Args:
        adopter (StateAdopter): the adopter to register; its ``name`` must be unused.
        prepend (bool): if True, try this adopter before all registered ones.

    Returns:
        torch.utils.hooks.RemovableHandle: ``handle.remove()`` unregisters it.
    """
    return _DEFAULT_REGISTRY.register(adopter, prepend=prepend)


def registered_state_adopters() -> Tuple[StateAdopterRegistration, ...]:
    """Return the process-wide registry's adopters in the order they are tried.

    Returns:
        Tuple[StateAdopterRegistration, ...]: each adopter with its name, origin and a handle
        that removes it (entry-point adopters included).
    """
    return _DEFAULT_REGISTRY.registrations()


def register_outcome_hook(hook: _OutcomeHook, prepend: bool = False) -> RemovableHandle:
    """Call ``hook(outcome)`` after every load or export through the process-wide registry.

    For example, to record which adopter installed the state::

        outcomes = []
        handle = register_outcome_hook(outcomes.append)
        ...  # load a checkpoint
        handle.remove()

    Args:
        hook (Callable[[StateAdoptionOutcome], None]): receives each outcome.
        prepend (bool): if True, call this hook before the already registered ones.

    Returns:
        torch.utils.hooks.RemovableHandle: ``handle.remove()`` unregisters the hook.
    """
    return _DEFAULT_REGISTRY.register_outcome_hook(hook, prepend=prepend)
