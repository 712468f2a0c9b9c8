# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""What Megatron-Core's optimizers call where they hand state to their inner optimizer.

Each function makes upstream's call unchanged (``load_state_dict``, ``state_dict()``,
Megatron-FSDP's dummy step, ``get_unscaled_state``/``set_scaled_state`` of a precision-aware
``dp_reshardable`` load) unless a registered adopter handles it; each hook point's rules are its
class below.
"""

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional

import torch
from torch.optim import optimizer as torch_optimizer

from . import checks
from .adopter import StateAdopter
from .dispatch import HookPoint, OutcomeRecord, Snapshot, adoption_enabled, consult, log, run
from .registry import StateAdopterRegistry

if TYPE_CHECKING:
    from megatron.core.optimizer.optimizer import MegatronOptimizer


class _Load(HookPoint[None]):
    """``load_state_dict``: an install must keep the incoming tensors themselves."""

    name, verb, upstream_method = "load", "installed", "load_state_dict"
    # PyTorch's loader replaces the state and the groups and may add to the defaults.
    changeable = ("state", "param_groups", "defaults")

    def upstream_hooks(self) -> Dict[str, object]:
        optimizer = self.optimizer
        return {
            "pre": getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", {}),
            "post": getattr(optimizer, "_optimizer_load_state_dict_post_hooks", {}),
        }

    def decline_reason(self, adopter: StateAdopter) -> Optional[str]:
        return adopter.decline_reason(self.context)

    def act(self, adopter: StateAdopter) -> None:
        self.params = [list(group["params"]) for group in self.optimizer.param_groups]
        adopter.adopt(self.context)

    def result_problem(self, result: None, adopter: StateAdopter) -> Optional[str]:
        assert self.context.state_dict is not None
        return checks.installed_state_problem(self.optimizer, self.context.state_dict, self.params)

    def own(self) -> None:
        assert self.context.state_dict is not None
        self.optimizer.load_state_dict(self.context.state_dict)  # type: ignore[arg-type]


def load_inner_optimizer_state_dict(
    owner: "MegatronOptimizer",
    state_dict: Dict[str, Any],
    *,
    owns_state_dict: bool = False,
    registry: Optional[StateAdopterRegistry] = None,
) -> None:
    """Loads ``state_dict`` into ``owner.optimizer``, through the first accepting adopter.

    Args:
        owner (MegatronOptimizer): the Megatron optimizer whose inner optimizer loads.
        state_dict (Dict[str, Any]): PyTorch's state dict of the inner optimizer.
        owns_state_dict (bool): the call site built the dict and its tensors and nobody else
            holds them, so tensors the optimizer does not hold yet may be installed by reference.
        registry (StateAdopterRegistry, optional): defaults to the process-wide one.
    """
    run(_Load(owner, registry, state_dict, owns_state_dict))


class _Export(HookPoint[Dict[str, Any]]):
    """``state_dict()``: an export must be the held state itself, changing nothing."""

    name, verb, upstream_method = "export", "exported", "state_dict"

    def upstream_hooks(self) -> Dict[str, object]:
        optimizer = self.optimizer
        return {
            "pre": getattr(optimizer, "_optimizer_state_dict_pre_hooks", {}),
            "post": getattr(optimizer, "_optimizer_state_dict_post_hooks", {}),
        }

    def decline_reason(self, adopter: StateAdopter) -> Optional[str]:
        return adopter.export_decline_reason(self.context)

    def act(self, adopter: StateAdopter) -> Dict[str, Any]:
        return adopter.export_state_dict(self.context)

    def result_problem(self, result: Dict[str, Any], adopter: StateAdopter) -> Optional[str]:
        return checks.exported_state_problem(self.optimizer, result)

    def own(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def result_state(self, result: Dict[str, Any]) -> object:
        return result.get("state") if isinstance(result, Mapping) else None


def export_inner_optimizer_state_dict(
    owner: "MegatronOptimizer", registry: Optional[StateAdopterRegistry] = None
) -> Dict[str, Any]:
    """Returns ``owner.optimizer.state_dict()``, or the first accepting adopter's export.

    Args:
        owner (MegatronOptimizer): the Megatron optimizer whose inner optimizer exports.
        registry (StateAdopterRegistry, optional): defaults to the process-wide one.

    Returns:
        Dict[str, Any]: PyTorch's state dict of the inner optimizer.
    """
    return run(_Export(owner, registry))


class _Initialize(HookPoint[None]):
    """The state a checkpoint is read into: the adopter creates it as its load accepts it. Where
    upstream's initialization is a step, the inner optimizer's own step without gradients then
    gives the groups a step's keys, which the read fills."""

    name, verb, upstream_method = "initialize", "initialized", "step"
    changeable = ("state", "param_groups")

    def __init__(
        self,
        owner: "MegatronOptimizer",
        own_initialization: Optional[Callable[[], None]],
        registry: Optional[StateAdopterRegistry],
        steps: bool,
    ) -> None:
        super().__init__(owner, registry)
        self.own_initialization, self.steps = own_initialization, steps

    def upstream_hooks(self) -> Dict[str, object]:
        if not self.steps:
            return {}
        optimizer = self.optimizer
        return {
            "pre": getattr(optimizer, "_optimizer_step_pre_hooks", {}),
            "post": getattr(optimizer, "_optimizer_step_post_hooks", {}),
            "global pre": torch_optimizer._global_optimizer_pre_hooks,
            "global post": torch_optimizer._global_optimizer_post_hooks,
        }

    def gate_reason(self) -> Optional[str]:
        optimizer = self.optimizer
        if len(optimizer.state) > 0:
            return "the optimizer holds state already, which the own initialization keeps"
        if not self.steps:
            return None
        for param in checks.params_of(optimizer):
            if param.grad is not None or getattr(param, "decoupled_grad", None) is not None:
                return "a parameter has a gradient, which a step would apply"
        return super().gate_reason()

    def decline_reason(self, adopter: StateAdopter) -> Optional[str]:
        return adopter.initialize_decline_reason(self.context)

    def act(self, adopter: StateAdopter) -> None:
        adopter.initialize(self.context)
        if self.steps:
            self.optimizer.step()

    def result_problem(self, result: None, adopter: StateAdopter) -> Optional[str]:
        problem = checks.initialized_state_problem(self.optimizer, checks.params_of(self.optimizer))
        if problem is not None:
            return problem
        held = checks.held_state_dict(self.optimizer)
        scaffold = replace(self.context, state_dict=held, owns_state_dict=True)
        problem = adopter.decline_reason(scaffold)
        return None if problem is None else f"its load declines the state: {problem}"

    def own(self) -> None:
        if self.own_initialization is not None:
            self.own_initialization()

    def own_label(self) -> str:
        own = self.own_initialization
        if own is None:
            return "the call site's own state"
        return getattr(own, "__qualname__", repr(own))


def initialize_inner_optimizer_state(
    owner: "MegatronOptimizer",
    own_initialization: Optional[Callable[[], None]] = None,
    registry: Optional[StateAdopterRegistry] = None,
    *,
    steps: bool = False,
) -> None:
    """Creates the state a checkpoint is read into through the first accepting adopter, or runs
    ``own_initialization``.

    Args:
        owner (MegatronOptimizer): the Megatron optimizer whose inner optimizer holds no state yet.
        own_initialization (Callable[[], None], optional): upstream's initialization
            (``init_state_fn``, a dummy step on zero gradients); None where upstream's code
            creates the state afterwards itself (the distributed optimizer's placeholders).
        registry (StateAdopterRegistry, optional): defaults to the process-wide one.
        steps (bool): upstream's initialization is a step (Megatron-FSDP's dummy step), whose
            group keys (``step``) the read fills: the inner optimizer's own step without
            gradients follows an adopter's initialization.
    """
    run(_Initialize(owner, own_initialization, registry, steps))


class _Read(HookPoint[torch.Tensor]):
    """The read targets of one sharded state dict built for loading.

    The adopters are asked at the first target (a build asking for none consults nobody); each
    target is checked as it is handed out; after one fails, upstream's serve the rest (nothing
    is read yet, so upstream's targets are right).
    """

    name, verb, upstream_method = "read", "supplied read targets for", "get_unscaled_state"

    def __init__(
        self, owner: "MegatronOptimizer", registry: Optional[StateAdopterRegistry]
    ) -> None:
        super().__init__(owner, registry)
        self.owner = owner
        self.adopter: Optional[StateAdopter] = None
        self.consulted = self.own_ran = False
        self.reason: Optional[str] = None
        self.targets: List[torch.Tensor] = []

    def gate_reason(self) -> Optional[str]:
        """Upstream's methods set on the instance run instead of any adopter."""
        for method in ("get_unscaled_state", "set_scaled_state"):
            if method in vars(self.optimizer):
                return f"the {type(self.optimizer).__name__} instance has its own {method}"
        return None

    def decline_reason(self, adopter: StateAdopter) -> Optional[str]:
        """Asks the adopter once per read."""
        return adopter.read_target_decline_reason(self.context)

    def act(self, adopter: StateAdopter) -> torch.Tensor:
        """The adopter's target for the current state."""
        return adopter.read_target(self.context, self.param, self.state_name)

    def result_problem(self, result: torch.Tensor, adopter: StateAdopter) -> Optional[str]:
        """Checks one target against the held state."""
        label = f"{self.state_name} of parameter {self.index.get(id(self.param))}"
        return checks.read_target_problem(
            self.optimizer, self.param, self.state_name, result, self.extents, label
        )

    def own(self) -> torch.Tensor:
        """Upstream's target: ``get_unscaled_state``."""
        unscaled: torch.Tensor = self.optimizer.get_unscaled_state(  # type: ignore[attr-defined]
            self.param, self.state_name
        )
        return unscaled

    def target(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """Returns the tensor state ``name`` of ``param`` is read into."""
        self.param, self.state_name = param, name
        if not self.consulted:
            self.consulted, self.reason = True, self.gate_reason()
            if self.reason is None:
                adopters = self.registry.adopters()
                snapshot = Snapshot(self.optimizer, None)
                self.adopter, self.reason = consult(self, adopters, snapshot)
            self.extents = checks.held_extents(self.optimizer)
            self.index = {id(p): i for i, p in enumerate(checks.params_of(self.optimizer))}
        if self.adopter is not None:
            try:
                target = self.act(self.adopter)
                problem = self.result_problem(target, self.adopter)
                if problem is None:
                    self.targets.append(target)
                    return target
                raise ValueError(problem)
            except Exception as error:
                self.reason = f"adopter {self.adopter.name!r} failed for {name}"
                self.adopter = None
                self.registry.fall_back(self.reason, error, "get_unscaled_state serves the rest")
        self.own_ran = True
        unscaled = self.own()
        self.targets.append(unscaled)
        return unscaled

    def finish(self, error: Optional[BaseException]) -> None:
        """Reports the read's outcome, if an adopter was asked."""
        if not self.consulted:
            return
        if self.registry.observed:
            OutcomeRecord(self).report(
                self.adopter, self.own_label() if self.own_ran else None, self.reason,
                self.targets, error,
            )  # fmt: skip
        else:
            log(self, self.adopter, self.reason)


_ACTIVE_READ: ContextVar[Optional[_Read]] = ContextVar("optimizer_state_read", default=None)


@contextmanager
def reading_optimizer_state(
    owner: "MegatronOptimizer", is_loading: bool, registry: Optional[StateAdopterRegistry] = None
) -> Iterator[None]:
    """Lets the read targets built within the block come from the first accepting adopter.

    Args:
        owner (MegatronOptimizer): a precision-aware ``DistributedOptimizer`` building its
            sharded state dict.
        is_loading (bool): whether the state dict is built for a load; a save (it must write
            FP32) changes nothing.
        registry (StateAdopterRegistry, optional): defaults to the process-wide one.
    """
    active = _ACTIVE_READ.get()
    if (
        not is_loading
        or not adoption_enabled(owner.config)
        or (active is not None and active.owner is owner)
    ):
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


def unscaled_state_or_read_target(
    owner: "MegatronOptimizer", param: torch.Tensor, name: str
) -> torch.Tensor:
    """Returns the tensor state ``name`` of ``param`` is read into.

    Within :func:`reading_optimizer_state`, that is the accepting adopter's checked target;
    otherwise upstream's ``owner.optimizer.get_unscaled_state(param, name)``.
    """
    read = _ACTIVE_READ.get()
    if read is None or read.owner is not owner:
        unscaled: torch.Tensor = owner.optimizer.get_unscaled_state(param, name)
        return unscaled
    return read.target(param, name)


def store_read_optimizer_state(
    owner: "MegatronOptimizer", param: torch.Tensor, name: str, tensor: torch.Tensor
) -> None:
    """Stores what was read for state ``name`` of ``param`` as ``set_scaled_state`` would.

    With adoption on, the held tensor read in place stays, and a BF16 tensor of a held BF16
    state's shape (TE's cast already) is copied in; everything else, and everything with
    adoption off, goes to ``owner.optimizer.set_scaled_state``.
    """
    optimizer: Any = owner.optimizer
    if adoption_enabled(owner.config):
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
