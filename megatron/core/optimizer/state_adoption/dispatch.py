# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""The dispatcher every hook point runs through.

With adoption switched off (``OptimizerConfig.optimizer_state_adoption``), a hook point runs
upstream's code and nothing else. Otherwise the registered adopters are asked in order; the
first that accepts acts, and its result is checked; if it raises or its result does not match,
the optimizer is restored and upstream's code runs.
"""

import abc
import logging
import weakref
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Dict,
    Generic,
    List,
    Mapping,
    Optional,
    Tuple,
    TypeVar,
    cast,
)

import torch

from megatron.core.utils import log_single_rank

from .adopter import AdoptionContext, StateAdopter
from .checks import extent, local, params_of, tensors_of
from .registry import AdoptionOutcome, StateAdopterRegistry, default_registry

if TYPE_CHECKING:
    from megatron.core.optimizer.optimizer import MegatronOptimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")
_MISSING = object()
# Levels of dicts and lists below an optimizer attribute or a state dict that a snapshot keeps:
# state -> entry -> value, param_groups -> group -> params.
_DEPTH = 4


def adoption_enabled(config: Optional["OptimizerConfig"]) -> bool:
    """Whether ``config.optimizer_state_adoption`` is set (a config without it: yes).

    Raises:
        TypeError: the field holds something other than a bool (e.g. the string ``"false"``).
    """
    enabled = getattr(config, "optimizer_state_adoption", True)
    if not isinstance(enabled, bool):
        raise TypeError(f"OptimizerConfig.optimizer_state_adoption is {enabled!r}, not a bool")
    return enabled


def _version(tensor: torch.Tensor) -> Optional[int]:
    try:
        return int(local(tensor)._version)
    except RuntimeError:  # an inference tensor has no version counter
        return None


def _containers(
    value: object, seen: Dict[int, object], depth: int = _DEPTH
) -> List[Tuple[Any, Any]]:
    """(container, shallow copy) of ``value`` and every dict and list within ``depth`` levels."""
    if depth == 0 or not isinstance(value, (dict, list)) or id(value) in seen:
        return []
    seen[id(value)] = value
    copy: Any = list(value) if isinstance(value, list) else dict(value)
    items = copy if isinstance(value, list) else list(copy.values())
    return [(value, copy)] + [pair for item in items for pair in _containers(item, seen, depth - 1)]


class Snapshot:
    """The containers of an optimizer and of a state dict, to restore them, and tensor versions.

    Only dicts and lists are copied, shallowly: tensors and other objects are kept by identity,
    so taking a snapshot copies no data and works for any state. A write into a tensor cannot be
    undone; it is seen by its version counter.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer; every attribute is captured.
        state_dict (Mapping, optional): the incoming state dict, which nobody may change.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, state_dict: Optional[Mapping[str, Any]]
    ) -> None:
        self._attributes = vars(optimizer)
        self._kept = dict(self._attributes)
        seen: Dict[int, object] = {id(self._attributes): self._attributes}
        self._by_attribute = {name: _containers(v, seen) for name, v in self._kept.items()}
        self._given = _containers(state_dict, seen)
        pairs = [pair for pairs in self._by_attribute.values() for pair in pairs] + self._given
        tensors = [v for _, c in pairs for v in (c if isinstance(c, list) else c.values())]
        tensors = [v for v in tensors + params_of(optimizer) if isinstance(v, torch.Tensor)]
        self._versions = [(tensor, _version(tensor)) for tensor in tensors]

    def restore(self) -> None:
        """Refills every container and puts back every attribute.

        Raises:
            RuntimeError: a tensor was written into, which no restore undoes.
        """
        for pairs in [*self._by_attribute.values(), self._given]:
            for container, copy in pairs:
                if isinstance(container, list):
                    container[:] = copy
                else:
                    container.clear()
                    container.update(copy)
        self._attributes.clear()
        self._attributes.update(self._kept)
        written = self.written()
        if written is not None:
            raise RuntimeError(f"Optimizer state adoption cannot undo this: {written}")

    def changed(self, changeable: Optional[Tuple[str, ...]] = ()) -> Optional[str]:
        """Returns what differs from the capture, other than in the ``changeable`` attributes
        (None: any attribute).

        Containers are compared by the identity of their items; tensors by their versions.
        """
        names = list(self._kept) + [name for name in self._attributes if name not in self._kept]
        for name in names:
            if changeable is None or name in changeable:
                continue
            if not _same_attribute(
                self._attributes.get(name, _MISSING), self._kept.get(name, _MISSING)
            ):
                return f"it replaced the optimizer's attribute {name!r}"
            if _differ(self._by_attribute.get(name, [])):
                return f"it changed the optimizer's {name!r}"
        if _differ(self._given):
            return "it changed the incoming state dict"
        return self.written()

    def written(self) -> Optional[str]:
        """Returns that a tensor was written into since the capture, or None."""
        count = sum(_version(tensor) != version for tensor, version in self._versions)
        if count == 0:
            return None
        return f"it wrote into {count} tensor(s) of the optimizer, its parameters or the state dict"


def _same_attribute(now: object, was: object) -> bool:
    """The same object, or an equal plain value (PyTorch's loader renews a profiling name)."""
    plain = (str, int, float, bool, bytes, torch.dtype)
    return now is was or (type(now) is type(was) and isinstance(now, plain) and now == was)


def _differ(pairs: List[Tuple[Any, Any]]) -> bool:
    for container, copy in pairs:
        if len(container) != len(copy):
            return True
        now = (
            container if isinstance(container, list) else [container.get(k, _MISSING) for k in copy]
        )
        was = copy if isinstance(copy, list) else list(copy.values())
        if any(a is not b for a, b in zip(now, was)):
            return True
    return False


class HookPoint(abc.ABC, Generic[T]):
    """One place where Megatron-Core hands an inner optimizer's state to the optimizer's code.

    A subclass names the method upstream calls there and says what the adopters are asked, what
    the accepting one does, how its result is checked, and what upstream runs instead.

    Args:
        owner (MegatronOptimizer): the Megatron optimizer whose inner optimizer is served.
        registry (StateAdopterRegistry, optional): defaults to the process-wide one.
        state_dict (Mapping, optional): a load's incoming state dict.
        owns_state_dict (bool): the call site built ``state_dict`` and its tensors.
    """

    #: ``AdoptionOutcome.hook_point``.
    name: ClassVar[str]
    #: What an adopter did, for the logs, e.g. ``"installed"``.
    verb: ClassVar[str]
    #: The inner optimizer's method upstream calls here. If the instance overrides it, or hooks
    #: are registered for it, upstream's code runs.
    upstream_method: ClassVar[str]
    #: Attributes of the inner optimizer the action may change (see Snapshot.changed); None:
    #: any, for an action that is the inner optimizer's own method.
    changeable: ClassVar[Optional[Tuple[str, ...]]] = ()

    def __init__(
        self,
        owner: "MegatronOptimizer",
        registry: Optional[StateAdopterRegistry] = None,
        state_dict: Optional[Mapping[str, Any]] = None,
        owns_state_dict: bool = False,
    ) -> None:
        self.optimizer: torch.optim.Optimizer = owner.optimizer
        self.registry = default_registry() if registry is None else registry
        self.context = AdoptionContext.for_owner(owner, state_dict, owns_state_dict)
        self.declines: List[Tuple[str, str]] = []

    @abc.abstractmethod
    def decline_reason(self, adopter: StateAdopter) -> Optional[str]:
        """Returns ``adopter``'s check of this call: None to accept, else why it declines."""

    @abc.abstractmethod
    def act(self, adopter: StateAdopter) -> T:
        """Returns the result of the accepting ``adopter``'s action."""

    @abc.abstractmethod
    def result_problem(self, result: T, adopter: StateAdopter) -> Optional[str]:
        """Returns how the action's ``result`` differs from what upstream's code gives, or None."""

    @abc.abstractmethod
    def own(self) -> T:
        """Returns the result of upstream's code."""

    def own_label(self) -> str:
        """Returns what upstream's call resolves to, e.g. ``"FusedAdam.load_state_dict"``."""
        name, method = type(self.optimizer).__name__, self.upstream_method
        if method in vars(self.optimizer):
            return f"{method} set on the {name} instance"
        return f"{name}.{method}"

    def result_state(self, result: T) -> object:
        """Returns the state an outcome measures: by default the inner optimizer's."""
        return self.optimizer.state

    def upstream_hooks(self) -> Dict[str, object]:
        """Returns the hook tables upstream's call runs, by kind (``"pre"``, ``"post"``)."""
        return {}

    def gate_reason(self) -> Optional[str]:
        """Returns why upstream's code runs without asking an adopter, or None."""
        method, optimizer = self.upstream_method, self.optimizer
        if method in vars(optimizer):
            return f"the {type(optimizer).__name__} instance has its own {method}"
        for kind, hooks in self.upstream_hooks().items():
            if not isinstance(hooks, Mapping) or len(hooks) > 0:
                return f"{kind}-hooks of {method} are registered, which upstream runs"
        return None


def consult(
    point: HookPoint[Any], adopters: Tuple[StateAdopter, ...], snapshot: Snapshot
) -> Tuple[Optional[StateAdopter], str]:
    """Returns the first of ``adopters`` whose check accepts, or None and why none does.

    A check that raises or returns no string declines. One that changes the optimizer or the
    state dict is undone and declines; one that writes into a tensor raises ``RuntimeError``.
    """
    for adopter in adopters:
        failure: Optional[BaseException] = None
        broken = True  # the check broke its contract: a fallback, not a plain decline
        try:
            answer: Any = point.decline_reason(adopter)
            decline, broken = answer, False
        except Exception as error:
            decline, failure = f"its check raised {type(error).__name__}: {error}", error
        except BaseException:
            snapshot.restore()
            raise
        changed = snapshot.changed()
        if changed is not None:
            snapshot.restore()
            decline, broken = f"its check changed the optimizer: {changed}", True
        elif decline is not None and not isinstance(decline, str):
            decline, broken = f"its check returned {decline!r}, not a reason", True
        if decline is None:
            return adopter, ""
        point.declines.append((adopter.name, decline))
        if broken:
            point.registry.fall_back(f"adopter {adopter.name!r}: {decline}", failure, "it declines")
    return None, "every adopter declined" if adopters else "no adopter is registered"


def attempt(
    point: HookPoint[T], adopter: StateAdopter, snapshot: Snapshot
) -> Tuple[bool, Optional[T]]:
    """Returns (True, result) of ``adopter``'s checked action, or (False, None) once undone."""
    try:
        result = point.act(adopter)
        changeable = point.changeable
        if changeable is not None:
            changeable += adopter.installed_attributes
        problem = snapshot.changed(changeable) or point.result_problem(result, adopter)
        if problem is None:
            return True, result
        error: BaseException = ValueError(f"its result does not match: {problem}")
    except Exception as raised:
        error = raised
    except BaseException:
        snapshot.restore()
        raise
    snapshot.restore()
    instead = f"the own code runs for {describe(point.optimizer)}"
    point.registry.fall_back(f"adopter {adopter.name!r} failed and was undone", error, instead)
    return False, None


def run(point: HookPoint[T]) -> T:
    """Returns the accepting adopter's checked result, or else upstream's (``point.own()``)."""
    if not adoption_enabled(point.context.config):
        return point.own()
    record = OutcomeRecord(point) if point.registry.observed else None
    adopter: Optional[StateAdopter] = None
    reason = point.gate_reason()
    method: Optional[str] = None
    result: Any = None
    try:
        adopters = point.registry.adopters() if reason is None else ()
        if reason is None and not adopters:
            reason = "no adopter is registered"
        if reason is None:
            snapshot = Snapshot(point.optimizer, point.context.state_dict)
            accepting, reason = consult(point, adopters, snapshot)
            if accepting is not None:
                done, result = attempt(point, accepting, snapshot)
                adopter = accepting if done else None
                if not done:
                    reason = f"adopter {accepting.name!r} failed and was undone"
        if adopter is None:
            method = point.own_label()
            result = point.own()
    except BaseException as error:
        if record is not None:
            record.report(None, method, reason, error=error)
        raise
    if record is not None:
        record.report(adopter, method, reason or None, point.result_state(result))
    else:
        log(point, adopter, reason)
    return cast(T, result)


class OutcomeRecord:
    """Measures and reports one call's outcome: created before the call, for the storages that
    existed then (held weakly: the call may free one and reuse its address)."""

    def __init__(self, point: HookPoint[Any]) -> None:
        self.point = point
        given = point.context.state_dict
        states = (point.optimizer.state, given.get("state") if isinstance(given, Mapping) else None)
        places = [(weakref.ref(t), extent(t)) for state in states for t in tensors_of(state)]
        self._storages = [(ref, place[0]) for ref, place in places if place is not None]

    def report(
        self,
        adopter: Optional[StateAdopter],
        method: Optional[str],
        reason: Optional[str],
        state: object = None,
        error: Optional[BaseException] = None,
    ) -> None:
        """Measures ``state`` (unless the call raised ``error``), logs and reports the outcome."""
        reused, allocated = (0, 0) if error is not None else self.measure(state)
        outcome = AdoptionOutcome(
            hook_point=self.point.name,
            optimizer=describe(self.point.optimizer),
            adopter=None if adopter is None else adopter.name,
            method=method,
            reused_bytes=reused,
            allocated_bytes=allocated,
            declines=tuple(self.point.declines),
            fallback_reason=reason if adopter is None else None,
            error=None if error is None else f"{type(error).__name__}: {error}",
        )
        log(self.point, adopter, reason, outcome)
        self.point.registry.report(outcome)

    def measure(self, state: object) -> Tuple[int, int]:
        """Returns the bytes of ``state`` in storage that existed before the call, and in new
        storage; each storage counted once, by the bytes its tensors span."""
        alive = set()
        for ref, storage in self._storages:
            tensor = ref()
            if tensor is not None and (extent(tensor) or (0,))[0] == storage:
                alive.add(storage)
        spans: Dict[int, List[Tuple[int, int]]] = {}
        for place in filter(None, map(extent, tensors_of(state))):
            spans.setdefault(place[0], []).append(place[1:])
        counts = [0, 0]
        for storage, ranges in spans.items():
            reached = 0
            for start, end in sorted(ranges):
                counts[storage not in alive] += max(0, end - max(start, reached))
                reached = max(reached, end)
        return counts[0], counts[1]


def describe(optimizer: torch.optim.Optimizer) -> str:
    """Names an inner optimizer so that a ChainedOptimizer's optimizers differ in the logs."""
    params = params_of(optimizer)
    elements = sum(local(p).numel() for p in params)
    name = type(optimizer).__name__
    return f"{name} {id(optimizer):#x} ({len(params)} params, {elements:,} elements)"


def log(
    point: HookPoint[Any],
    adopter: Optional[StateAdopter],
    reason: Optional[str],
    outcome: Optional[AdoptionOutcome] = None,
) -> None:
    """Logs an adoption at INFO on rank 0; declines and plain calls at DEBUG; errors warn."""
    if outcome is not None and outcome.error is not None:
        logger.warning(
            f"Optimizer state {point.name} of {outcome.optimizer} raised: {outcome.error}"
        )
        return
    level = logging.INFO if adopter is not None else logging.DEBUG
    if not logger.isEnabledFor(level):
        return
    what = describe(point.optimizer)
    sizes = ""
    if outcome is not None:
        sizes = f": {_size(outcome.reused_bytes)} by reference, "
        sizes += f"{_size(outcome.allocated_bytes)} newly allocated"
    if adopter is not None:
        message = (
            f"Optimizer state adopter {adopter.name!r} {point.verb} the state of {what}{sizes}"
        )
    else:
        declines = "; ".join(f"{name!r}: {why}" for name, why in point.declines)
        message = (
            f"{point.own_label()} ran for {what} ({reason}{'; ' if declines else ''}{declines})"
        )
    log_single_rank(logger, level, message)


def _size(count: int) -> str:
    return f"{count:,} B" if count < 2**20 else f"{count / 2**20:,.1f} MiB"
