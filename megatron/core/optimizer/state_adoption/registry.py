# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""The registry of state adopters and of the hooks told of every outcome."""

import logging
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Dict, Optional, Set, Tuple

from torch.utils.hooks import RemovableHandle

from megatron.core.utils import log_single_rank

from .adopter import StateAdopter

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "megatron_core.optimizer_state_adopters"
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class AdoptionOutcome:
    """What one call at a hook point did to an inner optimizer.

    Attributes:
        hook_point (str): ``"load"``, ``"export"``, ``"initialize"`` or ``"read"``.
        optimizer (str): the inner optimizer, e.g. ``"FusedAdam 0x7f3a2c1b (40 params, ...)"``.
        adopter (str, optional): the adopter that handled the call; None if the own code ran.
        method (str, optional): the own code that ran, e.g. ``"FusedAdam.load_state_dict"``.
        reused_bytes (int): bytes of the resulting state in storage that existed before the call
            (installed by reference), each storage counted once.
        allocated_bytes (int): bytes of the resulting state in storage the call created.
        declines (tuple): (adopter, reason) of every adopter that declined.
        fallback_reason (str, optional): why the own code ran.
        error (str, optional): the exception that ended the call (re-raised unchanged).
    """

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
        """Returns the outcome as a JSON-ready dict (``declines`` as a list of pairs)."""
        record = asdict(self)
        record["declines"] = [list(decline) for decline in self.declines]
        return record


OutcomeHook = Callable[[AdoptionOutcome], None]


class StateAdopterRegistry:
    """State adopters, tried in registration order, and the hooks told of every outcome.

    Registration follows PyTorch's ``register_*_hook``: it returns a
    :class:`~torch.utils.hooks.RemovableHandle`, and ``prepend=True`` puts the new entry first.
    The installed plugins (entry points of ``plugin_group``, by name) are registered when the
    registry is first consulted; each names a zero-argument callable returning an adopter::

        [project.entry-points."megatron_core.optimizer_state_adopters"]
        my_adam = "my_package.adoption:MyAdamStateAdopter"

    Args:
        strict (bool): a fallback (an adopter that raises or whose result does not match, a plugin
            that does not load, an outcome hook that raises) raises ``RuntimeError`` instead of
            warning. Tests run strict.
        plugin_group (str, optional): the entry-point group to load plugins from.
    """

    def __init__(self, *, strict: bool = False, plugin_group: Optional[str] = None) -> None:
        self.strict = strict
        self._plugin_group = plugin_group
        self._adopters: "OrderedDict[int, StateAdopter]" = OrderedDict()
        self._outcome_hooks: "OrderedDict[int, OutcomeHook]" = OrderedDict()
        self._warned: Set[str] = set()

    def register(self, adopter: StateAdopter, prepend: bool = False) -> RemovableHandle:
        """Registers a state adopter.

        Args:
            adopter (StateAdopter): the adopter; its name must be unique in the registry.
            prepend (bool): try it before every adopter registered so far.

        Returns:
            RemovableHandle: ``handle.remove()`` unregisters the adopter.

        Raises:
            TypeError: ``adopter`` is no :class:`StateAdopter` or its name is invalid.
            ValueError: an adopter of that name is registered.
        """
        if not isinstance(adopter, StateAdopter):
            raise TypeError(f"{adopter!r} is not a StateAdopter")
        if not isinstance(adopter.name, str) or not _NAME.fullmatch(adopter.name):
            raise TypeError(
                f"state adopter {adopter!r} has the name {adopter.name!r}; a name starts with a "
                "letter and has only letters, digits, '_', '.' and '-'"
            )
        if any(other.name == adopter.name for other in self._adopters.values()):
            raise ValueError(f"a state adopter named {adopter.name!r} is registered")
        return _add(self._adopters, adopter, prepend)

    def register_outcome_hook(self, hook: OutcomeHook, prepend: bool = False) -> RemovableHandle:
        """Registers ``hook(outcome)``, called on this rank after every consulting call.

        Outcomes are measured (``reused_bytes``, ``allocated_bytes``) only while a hook is
        registered.

        Args:
            hook (Callable[[AdoptionOutcome], None]): the hook.
            prepend (bool): call it before every hook registered so far.

        Returns:
            RemovableHandle: ``handle.remove()`` unregisters the hook.
        """
        if not callable(hook):
            raise TypeError(f"outcome hook {hook!r} is not callable")
        return _add(self._outcome_hooks, hook, prepend)

    def adopters(self) -> Tuple[StateAdopter, ...]:
        """Returns the registered adopters in the order they are tried, plugins loaded."""
        self.load_plugins()
        return tuple(self._adopters.values())

    @property
    def observed(self) -> bool:
        """Whether an outcome hook is registered (so that outcomes are measured)."""
        return len(self._outcome_hooks) > 0

    def report(self, outcome: AdoptionOutcome) -> None:
        """Hands ``outcome`` to every outcome hook; one that raises is a fallback."""
        for hook in tuple(self._outcome_hooks.values()):
            try:
                hook(outcome)
            except Exception as error:  # observing a call must not break it
                self.fall_back(f"outcome hook {hook!r} raised", error, "it is skipped")

    def fall_back(
        self, what: str, error: Optional[BaseException] = None, instead: str = ""
    ) -> None:
        """Warns once, on rank 0, that ``what`` failed and what runs ``instead``.

        Raises:
            RuntimeError: the registry is strict.
        """
        message = f"Optimizer state adoption: {what}"
        cause = f" ({type(error).__name__}: {error})" if error is not None else ""
        if self.strict:
            raise RuntimeError(f"{message}{cause} [strict registry]") from error
        if message not in self._warned:
            self._warned.add(message)
            instead = f"; {instead}" if instead else ""
            log_single_rank(logger, logging.WARNING, f"{message}{instead}{cause}")

    def load_plugins(self) -> None:
        """Registers the installed plugins' adopters, once; a broken plugin is a fallback.

        Every plugin is tried before a failure is reported, so that a broken one never keeps the
        others out. No lock is held while a plugin is imported: its import may itself construct
        an optimizer, which consults this registry.
        """
        group, self._plugin_group = self._plugin_group, None
        if group is None:
            return
        failures = []
        for entry_point in sorted(entry_points(group=group), key=lambda ep: ep.name):
            try:
                self.register(entry_point.load()())
            except Exception as error:  # a plugin must not break checkpoint loading
                failures.append((entry_point, error))
        for entry_point, failure in failures:
            dist = getattr(entry_point, "dist", None)
            origin = f"{entry_point.name} = {entry_point.value}"
            origin += f" ({dist.name} {dist.version})" if dist is not None else ""
            self.fall_back(f"the plugin {origin} failed", failure, "it is skipped")


def _add(entries: "OrderedDict[int, Any]", entry: object, prepend: bool) -> RemovableHandle:
    handle = RemovableHandle(entries)
    entries[handle.id] = entry
    if prepend:
        entries.move_to_end(handle.id, last=False)
    return handle


_DEFAULT_REGISTRY = StateAdopterRegistry(plugin_group=PLUGIN_GROUP)


def default_registry() -> StateAdopterRegistry:
    """Returns the process-wide registry Megatron-Core's optimizers consult."""
    return _DEFAULT_REGISTRY
