"""The functions Megatron-Core's optimizers call where they hand state to the inner optimizer.

Each stands in for one upstream line and runs it unchanged wherever no adopter handles the
call (see ``dispatch.run``):

* :func:`load_inner_optimizer_state_dict` for ``self.optimizer.load_state_dict(state_dict)`` in
  both branches of ``DistributedOptimizer.load_state_dict`` and in the non-distributed
  ``Float16OptimizerWithFloat16Params`` and ``FP32Optimizer``;
* :func:`export_inner_optimizer_state_dict` for ``self.optimizer.state_dict()`` in
  ``DistributedOptimizer.load_state_dict``;
* :func:`initialize_inner_optimizer_state` for Megatron-FSDP's dummy step on zero gradients;
* :func:`reading_optimizer_state` around a precision-aware ``dp_reshardable`` sharded state dict
  built for loading, whose read targets come from :func:`unscaled_state_or_read_target`
  (upstream: ``get_unscaled_state``) and are stored by :func:`store_read_optimizer_state`
  (upstream: ``set_scaled_state``).
"""

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

import torch

from .adopter import StateAdopter
from .checks import (
    exported_state_problem,
    held_extents,
    initialized_state_problem,
    installed_state_problem,
    local,
    params_of,
    read_target_problem,
    same_memory,
)
from .dispatch import Call, HookPoint, Snapshot, run
from .registry import StateAdopterRegistry

__all__ = [
    "export_inner_optimizer_state_dict",
    "initialize_inner_optimizer_state",
    "load_inner_optimizer_state_dict",
    "reading_optimizer_state",
    "store_read_optimizer_state",
    "unscaled_state_or_read_target",
]


def _own_label(optimizer: torch.optim.Optimizer, method: str) -> str:
    """What upstream's call resolves to, e.g. ``FusedAdam.load_state_dict``."""
    if method in getattr(optimizer, "__dict__", {}):
        return f"{method} set on the {type(optimizer).__name__} instance"
    return f"{type(optimizer).__name__}.{method}"


def load_inner_optimizer_state_dict(
    owner: Any,
    state_dict: Dict[str, Any],
    *,
    owns_state_dict: bool = False,
    registry: Optional[StateAdopterRegistry] = None,
) -> None:
    """Load ``state_dict`` into ``owner.optimizer`` through the first accepting adopter.

    Args:
        owner (Any): the Megatron optimizer (``DistributedOptimizer``,
            ``Float16OptimizerWithFloat16Params`` or ``FP32Optimizer``).
        state_dict (Dict[str, Any]): the ``{"state", "param_groups"}`` dict.
        owns_state_dict (bool): whether the call site built the dict and its tensors, so that
            nobody else holds them; only then may tensors the optimizer does not hold yet be
            installed by reference.
        registry (StateAdopterRegistry, optional): defaults to the process-wide registry.
    """
    optimizer = owner.optimizer

    def verify(_: None, snapshot: Snapshot) -> Optional[str]:
        return installed_state_problem(
            optimizer, snapshot.given, snapshot.params, snapshot.held, owns_state_dict
        )

    run(
        HookPoint.LOAD,
        owner,
        lambda adopter, context: adopter.adopt(context),
        verify,
        lambda: optimizer.load_state_dict(state_dict),
        own_label=_own_label(optimizer, "load_state_dict"),
        measured=lambda _: optimizer.state,
        registry=registry,
        state_dict=state_dict,
        owns_state_dict=owns_state_dict,
    )


def export_inner_optimizer_state_dict(
    owner: Any, registry: Optional[StateAdopterRegistry] = None
) -> Dict[str, Any]:
    """Return ``owner.optimizer``'s state dict, from the first accepting adopter.

    Args:
        owner (Any): the ``DistributedOptimizer``.
        registry (StateAdopterRegistry, optional): defaults to the process-wide registry.

    Returns:
        Dict[str, Any]: an export checked to be the held state, or ``optimizer.state_dict()``.
    """
    optimizer = owner.optimizer

    def verify(exported: Dict[str, Any], snapshot: Snapshot) -> Optional[str]:
        return snapshot.changed() or exported_state_problem(optimizer, exported)

    exported: Dict[str, Any] = run(
        HookPoint.EXPORT,
        owner,
        lambda adopter, context: adopter.export_state_dict(context),
        verify,
        optimizer.state_dict,
        own_label=_own_label(optimizer, "state_dict"),
        measured=lambda result: result.get("state") if isinstance(result, Mapping) else None,
        registry=registry,
    )
    return exported


def initialize_inner_optimizer_state(
    owner: Any,
    own_initialization: Callable[[], None],
    registry: Optional[StateAdopterRegistry] = None,
) -> None:
    """Create ``owner.optimizer``'s state for a checkpoint to be read into.

    An accepting adopter lets the optimizer's own ``step()`` run without gradients, which must
    create the state of every parameter; otherwise ``own_initialization`` runs.

    Args:
        owner (Any): the Megatron-FSDP ``DistributedOptimizer``.
        own_initialization (Callable[[], None]): upstream's dummy step on zero gradients.
        registry (StateAdopterRegistry, optional): defaults to the process-wide registry.
    """
    optimizer = owner.optimizer

    def verify(_: None, snapshot: Snapshot) -> Optional[str]:
        return initialized_state_problem(optimizer, snapshot.params, snapshot.groups)

    run(
        HookPoint.INITIALIZE,
        owner,
        lambda adopter, context: optimizer.step(),
        verify,
        own_initialization,
        own_label=getattr(own_initialization, "__qualname__", repr(own_initialization)),
        measured=lambda _: optimizer.state,
        registry=registry,
    )


class _Read:
    """The read targets of one sharded state dict being built for loading; the adopters are
    asked at the first target, so a build that asks for none consults nobody."""

    def __init__(self, owner: Any, registry: Optional[StateAdopterRegistry]) -> None:
        self.owner, self.call = owner, Call(HookPoint.READ, owner, registry)
        self.adopter: Optional[StateAdopter] = None
        self.reason: Optional[str] = None
        self.consulted = False
        self.failure: Optional[str] = None
        self.targets: List[torch.Tensor] = []

    def target(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """The accepting adopter's checked target, or upstream's ``get_unscaled_state``."""
        optimizer: Any = self.owner.optimizer
        if not self.consulted:
            self.consulted = True
            self.adopter, self.reason = self.call.consult()
            self.extents = held_extents(optimizer)
            self.index = {id(p): i for i, p in enumerate(params_of(optimizer))}
        if self.adopter is not None and self.failure is None:
            label = f"{name} of parameter {self.index.get(id(param))}"
            try:
                target = self.adopter.read_target(self.call.context, param, name)
                problem = read_target_problem(optimizer, param, name, target, self.extents, label)
                if problem is not None:
                    raise ValueError(problem)
                self.targets.append(target)
                return target
            except Exception as error:  # nothing is read yet: upstream's targets are right
                self.failure = f"adopter {self.adopter.name!r} failed for {label}"
                self.call.registry.fall_back(
                    f"{self.failure}; get_unscaled_state serves the rest", error
                )
        unscaled: torch.Tensor = optimizer.get_unscaled_state(param, name)
        self.targets.append(unscaled)
        return unscaled

    def finish(self, error: Optional[BaseException]) -> None:
        """End a consulted read in its outcome."""
        if self.consulted:
            own = f"{type(self.owner.optimizer).__name__}.get_unscaled_state"
            adopter = self.adopter.name if self.adopter is not None else None
            self.call.finish(
                adopter=adopter,
                method=None if adopter else own,
                reason=self.failure or self.reason or None,
                result=self.targets,
                error=error,
            )


_ACTIVE_READ: ContextVar[Optional[_Read]] = ContextVar("optimizer_state_read", default=None)


@contextmanager
def reading_optimizer_state(
    owner: Any, is_loading: bool, registry: Optional[StateAdopterRegistry] = None
) -> Iterator[None]:
    """Within the block, ``owner``'s read targets may come from the first accepting adopter.

    Nothing changes for a save (``is_loading`` False, which must write FP32) or outside the
    block. The block ends in one outcome if any target was asked for.

    Args:
        owner (Any): the precision-aware ``DistributedOptimizer`` building its sharded state
            dict.
        is_loading (bool): whether the sharded state dict is built to load a checkpoint.
        registry (StateAdopterRegistry, optional): defaults to the process-wide registry.
    """
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
    """The tensor state ``name`` of ``param`` is read into.

    Args:
        owner (Any): the precision-aware ``DistributedOptimizer``.
        param (torch.Tensor): the inner optimizer's parameter.
        name (str): the state's name.

    Returns:
        torch.Tensor: inside :func:`reading_optimizer_state` for ``owner``, the accepting
        adopter's read target; otherwise ``owner.optimizer.get_unscaled_state(param, name)``.
    """
    read = _ACTIVE_READ.get()
    if read is None or read.owner is not owner:
        unscaled: torch.Tensor = owner.optimizer.get_unscaled_state(param, name)
        return unscaled
    return read.target(param, name)


def store_read_optimizer_state(
    owner: Any, param: torch.Tensor, name: str, tensor: torch.Tensor
) -> None:
    """Store the values read for state ``name`` of ``param`` as ``set_scaled_state`` would.

    The held tensor itself was read into in place and stays as it is; a BF16 tensor of the
    held BF16 state's shape holds TE's cast already and is copied in; anything else goes to
    ``set_scaled_state``.

    Args:
        owner (Any): the precision-aware ``DistributedOptimizer``.
        param (torch.Tensor): the inner optimizer's parameter.
        name (str): the state's name.
        tensor (torch.Tensor): the values read.
    """
    optimizer: Any = owner.optimizer
    entry = optimizer.state.get(param)
    held = entry.get(name) if isinstance(entry, Mapping) else None
    if isinstance(held, torch.Tensor):
        held = local(held)
        if same_memory(held, tensor):
            return
        if held.dtype == tensor.dtype == torch.bfloat16 and held.shape == tensor.shape:
            held.copy_(tensor)
            return
    optimizer.set_scaled_state(param, name, tensor)
