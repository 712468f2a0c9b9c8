"""Shared builders: stand-in optimizers, owners, registries and comparisons."""

import dataclasses
from typing import Any, Dict, List, Optional

import torch
from fused_adam_standin import FusedAdamStandIn

from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import (
    AdoptionContext,
    AdoptionOutcome,
    StateAdopter,
    StateAdopterRegistry,
    TEFusedAdamPrecisionAwareStateAdopter,
    export_inner_optimizer_state_dict,
    load_inner_optimizer_state_dict,
)
from megatron.core.optimizer.state_adoption.te_fused_adam import TEFusedAdamFP32StateAdopter

PARAM_SHAPES = [(64,), (16, 8), (7,), (33,)]
GROUP_SIZES = [2, 2]


@dataclasses.dataclass
class Owner:
    """What the call-site functions read of a Megatron optimizer (a DistributedOptimizer's)."""

    optimizer: torch.optim.Optimizer
    config: Any = dataclasses.field(default_factory=OptimizerConfig)
    ddp_config: Any = dataclasses.field(default_factory=DistributedDataParallelConfig)
    is_stub_optimizer: bool = False


def make_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> List[torch.nn.Parameter]:
    """CPU parameters shaped like flattened and unflattened main-param shards."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype)) for s in PARAM_SHAPES]


def make_standin(params: List[torch.nn.Parameter], **kwargs: Any) -> FusedAdamStandIn:
    """A stand-in FusedAdam with two param groups of different hyper-parameters."""
    groups = [
        {"params": params[: GROUP_SIZES[0]]},
        {"params": params[GROUP_SIZES[0] :], "lr": 5e-4, "weight_decay": 0.0},
    ]
    return FusedAdamStandIn(groups, lr=1e-3, weight_decay=0.01, **kwargs)


def set_grads(params: List[torch.nn.Parameter], step: int) -> None:
    """Deterministic gradients that depend only on the step index."""
    generator = torch.Generator().manual_seed(1000 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)


def trained_standin(steps: int = 2, **kwargs: Any) -> FusedAdamStandIn:
    """A stand-in that took ``steps`` steps, so its state is populated."""
    params = make_params()
    optimizer = make_standin(params, **kwargs)
    for step in range(steps):
        set_grads(params, step)
        optimizer.step()
    return optimizer


def fresh_standin(**kwargs: Any) -> FusedAdamStandIn:
    """A stand-in with the same parameter values as ``trained_standin`` and no state."""
    return make_standin(make_params(), **kwargs)


def cloned_state_dict(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's state dict with every state tensor cloned (a checkpoint's payload)."""
    state_dict = optimizer.state_dict()
    state_dict["state"] = {
        key: {name: value.clone() for name, value in entry.items()}
        for key, entry in state_dict["state"].items()
    }
    return state_dict


def make_context(optimizer: torch.optim.Optimizer, state_dict: Any = None, **fields: Any) -> AdoptionContext:
    """A context as a FP32, non-FSDP DistributedOptimizer builds it (``Owner`` fields may
    be changed: ``config=...``)."""
    owner_fields = {k: fields.pop(k) for k in ("config", "ddp_config", "is_stub_optimizer") if k in fields}
    return AdoptionContext.for_owner(Owner(optimizer, **owner_fields), state_dict=state_dict, **fields)


def registry_of(*adopters: StateAdopter, strict: bool = True) -> StateAdopterRegistry:
    """A registry holding exactly ``adopters``, in order (strict unless asked otherwise)."""
    registry = StateAdopterRegistry(strict=strict)
    for adopter in adopters:
        registry.register(adopter)
    return registry


class StandInFP32Adopter(TEFusedAdamFP32StateAdopter):
    """The built-in FP32 adopter under its own name (the process-wide registry holds the
    built-in one), recognising the stand-in."""

    name = "te_fused_adam_fp32_standin"


def standin_adopter(device_type: str = "cpu", te_version: str = "2.20.2") -> TEFusedAdamFP32StateAdopter:
    """The built-in FP32 adopter, recognising the stand-in instead of TE's FusedAdam."""
    return TEFusedAdamFP32StateAdopter(FusedAdamStandIn, device_type, te_version)


def precision_aware_adopter() -> TEFusedAdamPrecisionAwareStateAdopter:
    """The built-in precision-aware adopter, recognising the stand-in."""
    return TEFusedAdamPrecisionAwareStateAdopter(FusedAdamStandIn, "cpu")


def load_through(
    optimizer: torch.optim.Optimizer,
    state_dict: Any,
    registry: StateAdopterRegistry,
    owns_state_dict: bool = True,
    **owner_fields: Any,
) -> AdoptionOutcome:
    """Load ``state_dict`` as DistributedOptimizer's main branch does; return the outcome."""
    outcomes: List[AdoptionOutcome] = []
    handle = registry.register_outcome_hook(outcomes.append)
    try:
        load_inner_optimizer_state_dict(
            Owner(optimizer, **owner_fields), state_dict, owns_state_dict=owns_state_dict, registry=registry
        )
    finally:
        handle.remove()
    return outcomes[-1]


def export_through(
    optimizer: torch.optim.Optimizer, registry: StateAdopterRegistry, **owner_fields: Any
) -> Dict[str, Any]:
    """Read ``optimizer``'s state dict as DistributedOptimizer.load_state_dict does."""
    return export_inner_optimizer_state_dict(Owner(optimizer, **owner_fields), registry=registry)


def state_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every state tensor, in parameter order then key order."""
    return [
        optimizer.state[p][key]
        for group in optimizer.param_groups
        for p in group["params"]
        for key in sorted(optimizer.state[p])
    ]


def assert_bitwise_equal(left: List[torch.Tensor], right: List[torch.Tensor]) -> None:
    """Assert two tensor lists are equal bit for bit, dtype and shape included."""
    assert len(left) == len(right)
    for a, b in zip(left, right):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def config_with(**changes: Any) -> OptimizerConfig:
    """An OptimizerConfig with the given fields changed."""
    return dataclasses.replace(OptimizerConfig(), **changes)


def ddp_config_with(**changes: Any) -> DistributedDataParallelConfig:
    """A DistributedDataParallelConfig with the given fields changed."""
    return dataclasses.replace(DistributedDataParallelConfig(), **changes)


def numel_bytes(optimizer: torch.optim.Optimizer, per_element: int = 8) -> int:
    """``per_element`` bytes for every element of every parameter."""
    return per_element * sum(p.numel() for g in optimizer.param_groups for p in g["params"])


def outcome_of(registry: StateAdopterRegistry, call: Any, point: Optional[str] = None) -> AdoptionOutcome:
    """Run ``call()`` and return the last outcome it produced (at ``point``, if given)."""
    outcomes: List[AdoptionOutcome] = []
    handle = registry.register_outcome_hook(outcomes.append)
    try:
        call()
    finally:
        handle.remove()
    matching = [o for o in outcomes if point is None or o.hook_point == point]
    assert matching, f"no outcome at {point}: {outcomes}"
    return matching[-1]
