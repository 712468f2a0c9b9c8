"""The one dispatcher every hook point runs through: the gate (the config switch; a method set
on the instance, hooks: what upstream runs), the first accepting adopter acting under a snapshot
(restored if it raises or its result fails the check), the measurement and one outcome; else
upstream's own code, unchanged."""

import copy
import enum
import logging
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, TypeVar

import torch
from torch.optim import optimizer as torch_optimizer

from megatron.core.utils import log_single_rank

from .adopter import AdoptionContext, StateAdopter
from .checks import extent, local, params_of, tensors_of
from .registry import AdoptionOutcome, StateAdopterRegistry, default_registry

logger = logging.getLogger(__name__)

T = TypeVar("T")
_MISSING = object()
_DECLINE = "it counts as a decline"


class HookPoint(enum.StrEnum):
    """Where Megatron-Core hands an inner optimizer's state to its own code."""

    LOAD = "load"
    EXPORT = "export"
    INITIALIZE = "initialize"
    READ = "read"


# Per hook point: the adopters' check, a verb for the logs, and upstream's calls (set on the
# instance, they run; so do the hooks of the first).
GATES: Dict[HookPoint, Tuple[str, str, Tuple[str, ...]]] = {
    HookPoint.LOAD: ("decline_reason", "installed", ("load_state_dict",)),
    HookPoint.EXPORT: ("export_decline_reason", "exported", ("state_dict",)),
    HookPoint.INITIALIZE: ("initialize_decline_reason", "initialized", ("step",)),
    HookPoint.READ: (
        "read_target_decline_reason",
        "supplied read targets for",
        ("get_unscaled_state", "set_scaled_state"),
    ),
}


def gate_reason(point: HookPoint, owner: Any, registry: StateAdopterRegistry) -> Optional[str]:
    """Why the own code must run without asking any adopter, or None."""
    if registry.switched_off is not None:
        return registry.switched_off
    enabled = getattr(getattr(owner, "config", None), "optimizer_state_adoption", True)
    if enabled is not True:
        return f"OptimizerConfig.optimizer_state_adoption is {enabled!r}"
    optimizer, methods = owner.optimizer, GATES[point][2]
    for method in methods:
        if method in vars(optimizer):
            return f"the {type(optimizer).__name__} instance has its own {method}, which upstream calls"
    kinds = () if point is HookPoint.READ else ("pre", "post")
    tables = [getattr(optimizer, f"_optimizer_{methods[0]}_{kind}_hooks", None) for kind in kinds]
    if point is HookPoint.INITIALIZE:
        tables += [getattr(torch_optimizer, f"_global_optimizer_{k}_hooks", None) for k in kinds]
        if len(optimizer.state) > 0:
            return "the optimizer holds state already, which the own initialization steps"
        params = params_of(optimizer)
        if any(getattr(p, a, None) is not None for p in params for a in ("grad", "decoupled_grad")):
            return "a parameter has a gradient, which a step would apply"
    if any(not isinstance(hooks, Mapping) or len(hooks) > 0 for hooks in tables):
        return "hooks are registered (or cannot be inspected) that upstream runs"
    return None


def own_label(point: HookPoint, optimizer: torch.optim.Optimizer) -> str:
    """What upstream's call resolves to, e.g. ``FusedAdam.load_state_dict``."""
    method = GATES[point][2][0]
    if method in vars(optimizer):
        return f"{method} set on the {type(optimizer).__name__} instance"
    return f"{type(optimizer).__name__}.{method}"


def _containers(value: Any, depth: int = 5) -> List[Tuple[Any, Any]]:
    """(container, shallow copy) of every dict and list reached within ``depth`` levels."""
    if depth == 0 or not isinstance(value, (dict, list)):
        return []
    items = value if isinstance(value, list) else list(value.values())
    pairs = [(value, list(value) if isinstance(value, list) else dict(value))]
    return pairs + [pair for item in items for pair in _containers(item, depth - 1)]


class Snapshot:
    """Before an adopter acts: the optimizer's and the incoming dict's containers, to restore them
    exactly (the same objects, refilled), and each tensor's version, to see writes (which nothing
    undoes). ``params`` per group, ``held`` entries by ``id(param)``, ``given``: the dict, copied.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        self._optimizer, self._state = optimizer, optimizer.state
        self._groups = optimizer.param_groups
        self._containers = _containers([optimizer.state, optimizer.param_groups, state_dict])
        self.params = [list(group["params"]) for group in optimizer.param_groups]
        self.held = {id(key): dict(entry) for key, entry in optimizer.state.items()}
        copies = [c if isinstance(c, list) else list(c.values()) for _, c in self._containers]
        tensors_kept = {id(v): v for c in copies for v in c if isinstance(v, torch.Tensor)}
        self.given = copy.deepcopy(state_dict, tensors_kept)  # its containers; tensors shared
        tensors = tensors_of(self.held) + params_of(optimizer)
        tensors += tensors_of(self.given.get("state") if isinstance(self.given, dict) else None)
        self._versions = [(tensor, int(local(tensor)._version)) for tensor in tensors]

    def restore(self) -> None:
        """Refill every container; put back the optimizer's ``state`` and ``param_groups``
        attributes where PyTorch's loader replaced them."""
        for container, copy in self._containers:
            if isinstance(container, list):
                container[:] = copy
            else:
                container.clear()
                container.update(copy)
        self._optimizer.state, self._optimizer.param_groups = self._state, self._groups

    def changed(self) -> Optional[str]:
        """What differs from the capture: a container (by identity) or a tensor's contents."""
        optimizer = self._optimizer
        if optimizer.state is not self._state or optimizer.param_groups is not self._groups:
            return "it replaced the optimizer's state or param groups"
        for container, copy in self._containers:
            is_list = isinstance(container, list)
            now = container if is_list else [container.get(key, _MISSING) for key in copy]
            was = copy if is_list else list(copy.values())
            if len(container) != len(copy) or any(a is not b for a, b in zip(now, was)):
                return "it changed the optimizer's containers or the state dict's"
        return self.written()

    def written(self) -> Optional[str]:
        """That a tensor was written into since the capture, or None."""
        count = sum(int(local(tensor)._version) != version for tensor, version in self._versions)
        if count == 0:
            return None
        return f"it wrote into {count} tensor(s) of the state, parameters or state dict"


class Call:
    """One call at a hook point: its context, the adopters' declines, and one outcome."""

    def __init__(
        self, point: HookPoint, owner: Any, registry: Optional[StateAdopterRegistry], **fields: Any
    ) -> None:
        self.point, self.owner, self.optimizer = point, owner, owner.optimizer
        self.registry = default_registry() if registry is None else registry
        self.context = AdoptionContext.for_owner(owner, **fields)
        given = self.context.state_dict
        states = (self.optimizer.state, given.get("state") if isinstance(given, Mapping) else None)
        # The storages before the call, held weakly: the call may free one and reuse its address.
        places = [(weakref.ref(t), extent(t)) for state in states for t in tensors_of(state)]
        self._storages = [(tensor, place[0]) for tensor, place in places if place is not None]
        self.declines: List[Tuple[str, str]] = []
        self.finished = False

    def consult(self) -> Tuple[Optional[StateAdopter], Optional[str]]:
        """The first adopter whose check accepts, or None and why none. A check that raises,
        answers nonsense or changes containers (undone) declines; one that writes raises.
        """
        reason = gate_reason(self.point, self.owner, self.registry)
        if reason is not None:
            return None, reason
        fall_back = self.registry.fall_back
        for adopter, _ in self.registry.registrations():
            before = Snapshot(self.optimizer, self.context.state_dict)
            try:
                decline = getattr(adopter, GATES[self.point][0])(self.context)
            except Exception as error:
                decline = f"its check raised {type(error).__name__}: {error}"
                fall_back(f"adopter {adopter.name!r} raised in its check", error, _DECLINE)
            if before.changed() is not None:
                before.restore()
                if before.written() is not None:
                    raise RuntimeError(f"adopter {adopter.name!r} wrote into tensors in its check")
                fall_back(
                    f"adopter {adopter.name!r} changed the optimizer in its check", None, _DECLINE
                )
                decline = "its check changed the optimizer"
            if decline is None:
                return adopter, None
            if not isinstance(decline, str):
                fall_back(
                    f"adopter {adopter.name!r} answered {decline!r} in its check", None, _DECLINE
                )
                decline = f"its check returned a {type(decline).__name__}"
            self.declines.append((adopter.name, decline))
        return None, ("every adopter declined" if self.declines else "no adopter is registered")

    def finish(
        self,
        adopter: Optional[str],
        method: Optional[str],
        reason: Optional[str],
        result: Any = None,
        error: Optional[BaseException] = None,
    ) -> None:
        """Measure ``result`` (a state mapping or tensors), log the outcome and report it, once."""
        if self.finished:
            return
        self.finished = True
        reused, allocated = (0, 0) if error is not None else self.measure(result)
        failure = None if error is None else f"{type(error).__name__}: {error}"
        outcome = AdoptionOutcome(
            self.point.value, describe(self.optimizer), adopter, method, reused, allocated,
            tuple(self.declines), reason, failure,
        )  # fmt: skip
        log(outcome, GATES[self.point][1])
        self.registry.report(outcome)

    def measure(self, state: Any) -> Tuple[int, int]:
        """(bytes in storage alive since before the call, in new storage) of ``state``; each
        storage counted once, by the bytes its tensors span."""
        kept = [(storage, ref()) for ref, storage in self._storages]
        alive = {s for s, t in kept if t is not None and (extent(t) or (0,))[0] == s}
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
    """The first accepting adopter's ``attempt`` if ``verify`` (against the own code's result)
    finds nothing wrong with it, else upstream's ``own()`` (named ``own_name`` in the outcome);
    ``fields`` complete the adopters' context (a load's state dict)."""
    call = Call(point, owner, registry, **fields)
    method: Optional[str] = None
    reason: Optional[str] = "interrupted while consulting the adopters"

    def measured(result: Any) -> Any:
        if point is not HookPoint.EXPORT:
            return call.optimizer.state
        return result.get("state") if isinstance(result, Mapping) else None

    try:
        adopter, reason = call.consult()
        if adopter is not None:
            before = Snapshot(call.optimizer, call.context.state_dict)
            try:
                result = attempt(adopter, call.context)
                reason = verify(result, before)
                if reason is None:
                    call.finish(adopter.name, None, None, measured(result))
                    return result
                raise ValueError(f"its result does not match: {reason}")
            except Exception as error:
                before.restore()
                if before.written() is not None:  # no restore undoes that: never go on wrong
                    raise RuntimeError(
                        f"adopter {adopter.name!r} failed after {before.written()}"
                    ) from error
                reason = f"adopter {adopter.name!r} failed and was undone"
                instead = f"the own code runs for {describe(call.optimizer)}"
                call.registry.fall_back(reason, error, instead)
            except BaseException:
                before.restore()
                raise
        method = own_name or own_label(point, call.optimizer)
        own_result = own()
        call.finish(None, method, reason, measured(own_result))
        return own_result
    except BaseException as error:
        call.finish(None, method, reason, error=error)
        raise


def describe(optimizer: torch.optim.Optimizer) -> str:
    """Name an inner optimizer so that a ChainedOptimizer's optimizers differ in the logs."""
    params = params_of(optimizer)
    elements = sum(local(p).numel() for p in params)
    return f"{type(optimizer).__name__} {id(optimizer):#x} ({len(params)} params, {elements:,} elements)"


def _size(count: int) -> str:
    return f"{count:,} B" if count < 2**20 else f"{count / 2**20:,.1f} MiB"


def log(outcome: AdoptionOutcome, verb: str) -> None:
    """Declines at debug and the result at info on rank 0; errors on every rank."""
    for name, reason in outcome.declines:
        message = f"Optimizer state adopter {name!r} declined: {reason}"
        log_single_rank(logger, logging.DEBUG, message)
    sizes = f"{_size(outcome.reused_bytes)} by reference, {_size(outcome.allocated_bytes)} newly allocated"
    what = f"the state of {outcome.optimizer}"
    if outcome.error is not None:
        logger.warning(
            f"Optimizer state {outcome.hook_point} of {outcome.optimizer} raised: {outcome.error}"
        )
    elif outcome.adopter is not None:
        message = f"Optimizer state adopter {outcome.adopter!r} {verb} {what}: {sizes}"
        log_single_rank(logger, logging.INFO, message)
        if outcome.allocated_bytes > 0 and outcome.hook_point in ("load", "export"):
            logger.warning(f"{message}: new memory instead of the tensors it was given")
    else:
        message = f"{outcome.method} {verb} {what} ({outcome.fallback_reason}): {sizes}"
        log_single_rank(
            logger, logging.INFO if outcome.hook_point == "load" else logging.DEBUG, message
        )
