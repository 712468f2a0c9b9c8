"""What Megatron-Core's optimizers call where they hand state to the inner optimizer: each makes
upstream's call unchanged (``load_state_dict``, ``state_dict()``, Megatron-FSDP's dummy step,
``get_unscaled_state``/``set_scaled_state`` of a precision-aware ``dp_reshardable`` load) unless
an adopter handles it."""

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

import torch

from .adopter import StateAdopter
from . import checks
from .dispatch import Call, HookPoint, own_label, run
from .registry import StateAdopterRegistry


def load_inner_optimizer_state_dict(
    owner: Any,
    state_dict: Dict[str, Any],
    *,
    owns_state_dict: bool = False,
    registry: Optional[StateAdopterRegistry] = None,
) -> None:
    """``owner.optimizer.load_state_dict(state_dict)``, or the first accepting adopter's install.
    ``owns_state_dict``: the call site built the dict and its tensors (nobody else holds them),
    so tensors the optimizer does not hold yet may be installed by reference. ``registry``
    defaults to the process-wide one (also below)."""
    optimizer = owner.optimizer
    run(
        HookPoint.LOAD,
        owner,
        lambda adopter, context: adopter.adopt(context),
        lambda _, before: checks.installed_state_problem(
            optimizer, before.given, before.params, before.held
        ),
        lambda: optimizer.load_state_dict(state_dict),
        registry=registry,
        state_dict=state_dict,
        owns_state_dict=owns_state_dict,
    )


def export_inner_optimizer_state_dict(
    owner: Any, registry: Optional[StateAdopterRegistry] = None
) -> Dict[str, Any]:
    """``owner.optimizer.state_dict()``, or the first accepting adopter's export (checked to be
    the held state, changing nothing)."""
    optimizer = owner.optimizer
    exported: Dict[str, Any] = run(
        HookPoint.EXPORT,
        owner,
        lambda adopter, context: adopter.export_state_dict(context),
        lambda result, before: before.changed() or checks.exported_state_problem(optimizer, result),
        optimizer.state_dict,
        registry=registry,
    )
    return exported


def initialize_inner_optimizer_state(
    owner: Any,
    own_initialization: Callable[[], None],
    registry: Optional[StateAdopterRegistry] = None,
) -> None:
    """Megatron-FSDP's ``own_initialization()`` (a dummy step on zero gradients), or, if an
    adopter accepts, the optimizer's own ``step()`` without gradients, which must create the state
    of every parameter."""
    optimizer = owner.optimizer
    run(
        HookPoint.INITIALIZE,
        owner,
        lambda adopter, context: optimizer.step(),
        lambda _, before: checks.initialized_state_problem(
            optimizer, [p for g in before.params for p in g]
        ),
        own_initialization,
        own_name=getattr(own_initialization, "__qualname__", repr(own_initialization)),
        registry=registry,
    )


class _Read:
    """The read targets of one sharded state dict built for loading: the adopters are asked at
    the first target (a build asking for none consults nobody); after a target fails the check,
    upstream's serve the rest."""

    def __init__(self, owner: Any, registry: Optional[StateAdopterRegistry]) -> None:
        self.owner, self.call = owner, Call(HookPoint.READ, owner, registry)
        self.adopter: Optional[StateAdopter] = None
        self.consulted = self.serving = self.own = False
        self.reason: Optional[str] = None
        self.targets: List[torch.Tensor] = []

    def target(self, param: torch.Tensor, name: str) -> torch.Tensor:
        optimizer: Any = self.owner.optimizer
        if not self.consulted:
            self.consulted, self.reason = True, "interrupted while consulting the adopters"
            self.adopter, self.reason = self.call.consult()
            self.own = self.adopter is None
            self.serving, self.extents = self.adopter is not None, checks.held_extents(optimizer)
            self.index = {id(p): index for index, p in enumerate(checks.params_of(optimizer))}
        if self.serving and self.adopter is not None:
            label = f"{name} of parameter {self.index.get(id(param))}"
            try:
                target = self.adopter.read_target(self.call.context, param, name)
                problem = checks.read_target_problem(
                    optimizer, param, name, target, self.extents, label
                )
                if problem is not None:
                    raise ValueError(problem)
                self.targets.append(target)
                return target
            except Exception as error:  # nothing is read yet: upstream's targets are right
                self.serving, self.reason = (
                    False,
                    f"adopter {self.adopter.name!r} failed for {label}",
                )
                self.call.registry.fall_back(
                    self.reason, error, "get_unscaled_state serves the rest"
                )
        unscaled: torch.Tensor = optimizer.get_unscaled_state(param, name)
        self.targets.append(unscaled)
        return unscaled

    def finish(self, error: Optional[BaseException]) -> None:
        if self.consulted:
            adopter = self.adopter.name if self.adopter is not None else None
            method = own_label(HookPoint.READ, self.call.optimizer) if self.own else None
            self.call.finish(adopter, method, self.reason, self.targets, error)


_ACTIVE_READ: ContextVar[Optional[_Read]] = ContextVar("optimizer_state_read", default=None)


@contextmanager
def reading_optimizer_state(
    owner: Any, is_loading: bool, registry: Optional[StateAdopterRegistry] = None
) -> Iterator[None]:
    """Within the block, the read targets of ``owner`` (a precision-aware
    ``DistributedOptimizer`` building its sharded state dict) may come from the first accepting
    adopter; nothing changes for a save (``is_loading`` False: it must write FP32)."""
    active = _ACTIVE_READ.get()
    if not is_loading or (active is not None and active.owner is owner):
        yield
        return
    read = _Read(owner, registry)
    token = _ACTIVE_READ.set(read)
    try:
        yield
    except BaseException as error:
        read.finish(error)
        raise
    finally:
        _ACTIVE_READ.reset(token)
    read.finish(None)


def unscaled_state_or_read_target(owner: Any, param: torch.Tensor, name: str) -> torch.Tensor:
    """The tensor state ``name`` of ``param`` is read into: within
    :func:`reading_optimizer_state`, the accepting adopter's checked target; else upstream's
    ``owner.optimizer.get_unscaled_state(param, name)``."""
    read = _ACTIVE_READ.get()
    if read is None or read.owner is not owner:
        unscaled: torch.Tensor = owner.optimizer.get_unscaled_state(param, name)
        return unscaled
    return read.target(param, name)


def store_read_optimizer_state(
    owner: Any, param: torch.Tensor, name: str, tensor: torch.Tensor
) -> None:
    """Store what was read for state ``name`` of ``param`` as ``set_scaled_state`` would: the
    held tensor read in place stays; a BF16 tensor of a held BF16 state's shape holds TE's cast
    already and is copied in; anything else goes to ``owner.optimizer.set_scaled_state``.
    """
    optimizer: Any = owner.optimizer
    entry = optimizer.state.get(param)
    held = entry.get(name) if isinstance(entry, Mapping) else None
    if isinstance(held, torch.Tensor):
        held = checks.local(held)
        if checks.same_memory(held, tensor):
            return
        if held.dtype == tensor.dtype == torch.bfloat16 and held.shape == tensor.shape:
            held.copy_(tensor)
            return
    optimizer.set_scaled_state(param, name, tensor)
