"""The one dispatcher every hook point runs through.

:func:`run` does, for one call: the gate (the switches, and what upstream would run that no
adopter may skip: a method set on the optimizer instance, registered hooks), the consultation
(the first registered adopter whose check for this hook point accepts), the attempt under a
snapshot (restored if the adopter raises or its result fails the hook point's check), the
measurement of the result and exactly one :class:`~.outcome.AdoptionOutcome`. Wherever no
adopter handles the call, the own code runs exactly as upstream's line would.
"""

import enum
import logging
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, TypeVar, cast

import torch
from torch.optim import optimizer as torch_optimizer

from megatron.core.utils import log_single_rank

from .adopter import AdoptionContext, StateAdopter
from .checks import extent, local, params_of
from .outcome import AdoptionOutcome
from .registry import StateAdopterRegistry, default_registry

__all__: List[str] = []

logger = logging.getLogger(__name__)

T = TypeVar("T")
_MISSING = object()


class HookPoint(enum.StrEnum):
    """Where Megatron-Core hands an inner optimizer's state to its own code."""

    LOAD = "load"
    EXPORT = "export"
    INITIALIZE = "initialize"
    READ = "read"


# Per hook point: the adopter's check, what an adopter does there (for the logs), and the calls
# upstream makes, which run themselves when set on the instance (hooks of the first one too).
GATES: Dict[HookPoint, Tuple[str, str, Tuple[str, ...]]] = {
    HookPoint.LOAD: ("decline_reason", "installed", ("load_state_dict",)),
    HookPoint.EXPORT: ("export_decline_reason", "exported", ("state_dict",)),
    HookPoint.INITIALIZE: ("initialize_decline_reason", "initialized", ("step",)),
    HookPoint.READ: (
        "read_target_decline_reason",
        "supplied the read targets for",
        ("get_unscaled_state", "set_scaled_state"),
    ),
}


def gate_reason(point: HookPoint, owner: Any) -> Optional[str]:
    """Why the own code must run without asking any adopter, or None."""
    enabled = getattr(getattr(owner, "config", None), "optimizer_state_adoption", True)
    if enabled is not True:
        return f"OptimizerConfig.optimizer_state_adoption is {enabled!r}"
    optimizer, methods = owner.optimizer, GATES[point][2]
    for method in methods:
        if method in getattr(optimizer, "__dict__", {}):
            return f"the {type(optimizer).__name__} instance has its own {method}, which upstream calls"
    kinds = () if point is HookPoint.READ else ("pre", "post")
    hook_tables = [
        getattr(optimizer, f"_optimizer_{methods[0]}_{kind}_hooks", None) for kind in kinds
    ]
    if point is HookPoint.INITIALIZE:
        hook_tables += [
            getattr(torch_optimizer, f"_global_optimizer_{kind}_hooks", None) for kind in kinds
        ]
        if len(optimizer.state) > 0:
            return "the optimizer holds state already, which the own initialization steps"
        params = params_of(optimizer)
        if any(getattr(p, a, None) is not None for p in params for a in ("grad", "decoupled_grad")):
            return "a parameter has a gradient, which a step would apply"
    for hooks in hook_tables:
        if not isinstance(hooks, Mapping) or len(hooks) > 0:
            return "hooks are registered (or cannot be inspected) that upstream runs"
    return None


def describe(optimizer: torch.optim.Optimizer) -> str:
    """Name an inner optimizer so that a ChainedOptimizer's optimizers differ in the logs."""
    name = f"{type(optimizer).__name__} {id(optimizer):#x}"
    try:
        params = params_of(optimizer)
        return f"{name} ({len(params)} params, {sum(local(p).numel() for p in params):,} elements)"
    except Exception:  # a malformed optimizer is reported by its own code
        return name


def _tensors(state: Any) -> List[torch.Tensor]:
    """The tensors of a list of tensors or of a ``{key: {name: value}}`` state mapping."""
    if isinstance(state, Mapping):
        entries = [e for e in state.values() if isinstance(e, Mapping)]
        return [v for e in entries for v in e.values() if isinstance(v, torch.Tensor)]
    return [t for t in state if isinstance(t, torch.Tensor)] if isinstance(state, list) else []


class Existing:
    """The storages of the state tensors before a call, held weakly (the call may free them)."""

    def __init__(self, *states: Any) -> None:
        self._storages: List[Tuple[Callable[[], Any], int]] = []
        for tensor in (t for state in states for t in _tensors(state)):
            place = extent(tensor)
            if place is not None:
                self._storages.append((weakref.ref(tensor), place[0]))

    def measure(self, state: Any) -> Tuple[int, int]:
        """(bytes in storage alive since before the call, bytes in new storage) of ``state``,
        each storage's bytes counted once (the union of the ranges its tensors cover)."""
        alive = set()
        for reference, storage in self._storages:
            held = reference()
            place = extent(held) if held is not None else None
            if place is not None and place[0] == storage:
                alive.add(storage)
        ranges: Dict[int, List[Tuple[int, int]]] = {}
        for place in filter(None, map(extent, _tensors(state))):
            ranges.setdefault(place[0], []).append(place[1:])
        reused = allocated = 0
        for storage, spans in ranges.items():
            covered, reached = 0, 0
            for start, end in sorted(spans):
                covered += max(0, end - max(start, reached))
                reached = max(reached, end)
            reused, allocated = (
                (reused + covered, allocated) if storage in alive else (reused, allocated + covered)
            )
        return reused, allocated


def _copy(value: Any, depth: int = 4) -> Any:
    """``value`` with its dicts and lists copied ``depth`` levels deep (tensors shared)."""
    if depth == 0 or not isinstance(value, (dict, list)):
        return value
    if isinstance(value, list):
        return [_copy(item, depth - 1) for item in value]
    return {key: _copy(item, depth - 1) for key, item in value.items()}


def _containers(value: Any, depth: int = 5) -> List[Tuple[Any, Any]]:
    """(container, shallow copy) of every dict and list reached within ``depth`` levels."""
    if depth == 0 or not isinstance(value, (dict, list)):
        return []
    items = value if isinstance(value, list) else list(value.values())
    found = [(value, list(value) if isinstance(value, list) else dict(value))]
    return found + [pair for item in items for pair in _containers(item, depth - 1)]


def _version(tensor: torch.Tensor) -> int:
    """A tensor's version counter, which every in-place write advances (-1 if it has none)."""
    try:
        return int(local(tensor)._version)
    except RuntimeError:  # an inference tensor
        return -1


class Snapshot:
    """The optimizer's and the incoming dict's containers and the version counter of every
    tensor in them, taken before an adopter acts: to restore the containers exactly (the same
    objects, refilled) and to see what was written into a tensor, which nothing can undo.

    Attributes:
        params (List[List[Any]]): the optimizer's parameters, per group.
        held (Dict[int, Dict[str, Any]]): its state entries, by ``id(param)``.
        given (Any): the incoming dict with its containers copied (tensors shared).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        self._optimizer, self._state, self._groups = (
            optimizer,
            optimizer.state,
            optimizer.param_groups,
        )
        self._containers = _containers([optimizer.state, optimizer.param_groups, state_dict])
        self.params = [list(group["params"]) for group in optimizer.param_groups]
        self.held = {id(key): dict(entry) for key, entry in optimizer.state.items()}
        self.given = _copy(state_dict)
        tensors = [v for e in self.held.values() for v in e.values() if isinstance(v, torch.Tensor)]
        tensors += params_of(optimizer) + _tensors(
            self.given.get("state") if isinstance(self.given, dict) else None
        )
        self._versions = [(tensor, _version(tensor)) for tensor in tensors]

    def restore(self) -> None:
        """Put every container back as captured; the optimizer's ``state`` and
        ``param_groups`` attributes too, where PyTorch's loader replaced them."""
        for container, copy in self._containers:
            if isinstance(container, list):
                container[:] = copy
            else:
                container.clear()
                container.update(copy)
        self._optimizer.state, self._optimizer.param_groups = self._state, self._groups

    def changed(self) -> Optional[str]:
        """What differs from the capture: a container (by identity) or a tensor's contents."""
        if (
            self._optimizer.state is not self._state
            or self._optimizer.param_groups is not self._groups
        ):
            return "it replaced the optimizer's state or param groups"
        for container, copy in self._containers:
            items = (
                zip(container, copy)
                if isinstance(container, list)
                else ((container.get(k, _MISSING), v) for k, v in copy.items())
            )
            if len(container) != len(copy) or any(a is not b for a, b in items):
                return "it changed the optimizer's containers or the state dict's"
        return self.written()

    def written(self) -> Optional[str]:
        """What was written into a tensor since the capture (a restore cannot undo it), or None."""
        count = sum(_version(tensor) != version for tensor, version in self._versions)
        return (
            f"it wrote into {count} tensor(s) of the state, parameters or state dict"
            if count
            else None
        )


class Call:
    """One call at a hook point: its context, the declines, and exactly one outcome."""

    def __init__(
        self, point: HookPoint, owner: Any, registry: Optional[StateAdopterRegistry], **fields: Any
    ) -> None:
        self.point, self.owner = point, owner
        self.registry = default_registry() if registry is None else registry
        self.optimizer: torch.optim.Optimizer = owner.optimizer
        self.context = AdoptionContext.for_owner(owner, **fields)
        given = self.context.state_dict
        self.existing = Existing(
            self.optimizer.state, given.get("state") if isinstance(given, Mapping) else None
        )
        self.declines: List[Tuple[str, str]] = []
        self.finished = False

    def consult(self) -> Tuple[Optional[StateAdopter], str]:
        """The first adopter whose check accepts (each check must change nothing), or why none."""
        reason = gate_reason(self.point, self.owner)
        if reason is not None:
            return None, reason
        check = GATES[self.point][0]
        for adopter, _ in self.registry.registrations():
            snapshot = Snapshot(self.optimizer, self.context.state_dict)
            try:
                decline = getattr(adopter, check)(self.context)
            except Exception as error:
                decline = f"its check raised {type(error).__name__}: {error}"
                self.registry.fall_back(f"adopter {adopter.name!r} raised in its check", error)
            change = snapshot.changed()
            if change is not None:  # a check must change nothing
                snapshot.restore()
                if snapshot.written() is not None:
                    raise RuntimeError(f"adopter {adopter.name!r} wrote into tensors in its check")
                self.registry.fall_back(
                    f"adopter {adopter.name!r} was undone: {change} in its check"
                )
                decline = "its check changed the optimizer"
            if decline is None:
                return adopter, ""
            if not isinstance(decline, str):
                self.registry.fall_back(
                    f"adopter {adopter.name!r} returned {decline!r} from its check"
                )
                decline = f"its check returned a {type(decline).__name__}"
            self.declines.append((adopter.name, decline))
        return None, "every adopter declined" if self.declines else "no adopter is registered"

    def attempt(
        self,
        adopter: StateAdopter,
        action: Callable[[], T],
        verify: Callable[[T, Snapshot], Optional[str]],
    ) -> Tuple[Any, Optional[str]]:
        """Run ``action`` and ``verify`` its result; undo both on failure and say why."""
        snapshot = Snapshot(self.optimizer, self.context.state_dict)
        try:
            result = action()
            problem = verify(result, snapshot)
            if problem is not None:
                raise ValueError(f"its result does not match: {problem}")
            return result, None
        except Exception as error:
            snapshot.restore()
            written = snapshot.written()
            if written is not None:  # the restore cannot undo that: never continue silently wrong
                raise RuntimeError(
                    f"adopter {adopter.name!r} failed after {written}; the state cannot be restored"
                ) from error
            failure = f"adopter {adopter.name!r} failed and was undone"
            self.registry.fall_back(
                f"{failure}; the own code runs for {describe(self.optimizer)}", error
            )
            return None, failure
        except BaseException:
            snapshot.restore()
            raise

    def finish(
        self,
        adopter: Optional[str] = None,
        method: Optional[str] = None,
        reason: Optional[str] = None,
        result: Any = (),
        error: Optional[BaseException] = None,
    ) -> None:
        """Measure ``result``, log the outcome and hand it to the outcome hooks, once."""
        if self.finished:
            return
        self.finished = True
        reused, allocated = (0, 0) if error is not None else self.existing.measure(result)
        outcome = AdoptionOutcome(
            self.point.value, describe(self.optimizer), adopter, method, reused, allocated,
            tuple(self.declines), reason or None, None if error is None else f"{type(error).__name__}: {error}",
        )  # fmt: skip
        _log(outcome, GATES[self.point][1])
        self.registry.report(outcome)


def own_label(point: HookPoint, optimizer: torch.optim.Optimizer) -> str:
    """What upstream's call resolves to, e.g. ``FusedAdam.load_state_dict``."""
    method = GATES[point][2][0]
    if method in getattr(optimizer, "__dict__", {}):
        return f"{method} set on the {type(optimizer).__name__} instance"
    return f"{type(optimizer).__name__}.{method}"


def run(
    point: HookPoint,
    owner: Any,
    attempt: Callable[[StateAdopter, AdoptionContext], T],
    verify: Callable[[T, Snapshot], Optional[str]],
    own: Callable[[], T],
    *,
    own_name: Optional[str] = None,
    registry: Optional[StateAdopterRegistry] = None,
    **fields: Any,
) -> T:
    """Let the first accepting adopter handle the call, or run ``own`` as upstream does.

    Args:
        point (HookPoint): the hook point.
        owner (Any): the Megatron optimizer whose inner optimizer's state is handled.
        attempt (Callable): what the accepting adopter does; returns the call's result.
        verify (Callable): checks that result against the own code's; None if it holds.
        own (Callable): upstream's code.
        own_name (str, optional): names ``own`` in the outcome (default: upstream's method).
        registry (StateAdopterRegistry, optional): defaults to the process-wide registry.
        **fields (Any): more fields of the adopters' context (a load's state dict).

    Returns:
        T: the adopter's verified result, or ``own()``'s.
    """
    call = Call(point, owner, registry, **fields)
    method, reason = None, "interrupted while consulting the adopters"

    def state(result: Any) -> Any:  # what the outcome measures
        if point is not HookPoint.EXPORT:
            return call.optimizer.state
        return result.get("state") if isinstance(result, Mapping) else None

    try:
        adopter, reason = call.consult()
        if adopter is not None:
            result, failure = call.attempt(adopter, lambda: attempt(adopter, call.context), verify)
            if failure is None:
                call.finish(adopter=adopter.name, result=state(result))
                return cast(T, result)
            reason = failure
        method = own_name or own_label(point, call.optimizer)
        own_result = own()
        call.finish(method=method, reason=reason, result=state(own_result))
        return own_result
    except BaseException as error:
        call.finish(method=method, reason=reason, error=error)
        raise


def _size(count: int) -> str:
    """Bytes for people: ``1,856 B`` or ``17,014.0 MiB``."""
    return f"{count:,} B" if count < 2**20 else f"{count / 2**20:,.1f} MiB"


def _log(outcome: AdoptionOutcome, verb: str) -> None:
    """Log an outcome: declines at debug, the result at info (rank 0), errors on every rank."""
    for name, reason in outcome.declines:
        log_single_rank(
            logger, logging.DEBUG, f"Optimizer state adopter {name!r} declined: {reason}"
        )
    sizes = f"{_size(outcome.reused_bytes)} by reference, {_size(outcome.allocated_bytes)} newly allocated"
    what = f"the state of {outcome.optimizer}"
    if outcome.error is not None:
        logger.warning(
            f"Optimizer state {outcome.hook_point} of {outcome.optimizer} raised: {outcome.error}"
        )
    elif outcome.adopter is not None:
        message = f"Optimizer state adopter {outcome.adopter!r} {verb} {what}: {sizes}"
        log_single_rank(logger, logging.INFO, message)
        if outcome.allocated_bytes > 0 and outcome.hook_point in (HookPoint.LOAD, HookPoint.EXPORT):
            logger.warning(f"{message}: new memory instead of the tensors it was given")
    else:
        level = logging.INFO if outcome.hook_point == HookPoint.LOAD else logging.DEBUG
        log_single_rank(
            logger, level, f"{outcome.method} {verb} {what} ({outcome.fallback_reason}): {sizes}"
        )
