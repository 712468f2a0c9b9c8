"""Shared builders for the tests: stand-in optimizers, contexts and owners."""

import dataclasses
from typing import Any, Dict, List

import torch

from fused_adam_standin import FusedAdamStandIn

from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import (
    StateAdopterRegistry,
    StateAdoptionContext,
    StateAdoptionOutcome,
    export_inner_optimizer_state_dict,
    load_inner_optimizer_state_dict,
)
from megatron.core.optimizer.state_adoption.te_fused_adam import TEFusedAdamFP32StateAdopter

PARAM_SHAPES = [(64,), (16, 8), (7,), (33,)]
GROUP_SIZES = [2, 2]


@dataclasses.dataclass
class Owner:
    """What ``load_inner_optimizer_state_dict`` reads of a DistributedOptimizer."""

    optimizer: torch.optim.Optimizer
    config: Any = dataclasses.field(default_factory=OptimizerConfig)
    ddp_config: Any = dataclasses.field(default_factory=DistributedDataParallelConfig)
    is_stub_optimizer: bool = False


def make_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> List[torch.nn.Parameter]:
    """FP32 CPU parameters shaped like flattened and unflattened main-param shards."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype))
        for shape in PARAM_SHAPES
    ]


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
    """The optimizer's state dict with every state tensor cloned (a 'scaffold' payload)."""
    state_dict = optimizer.state_dict()
    state_dict["state"] = {
        key: {name: value.clone() for name, value in entry.items()}
        for key, entry in state_dict["state"].items()
    }
    return state_dict


def make_context(
    optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any], **overrides: Any
) -> StateAdoptionContext:
    """A context as a non-FSDP, non-offloaded, FP32 DistributedOptimizer would build it."""
    return StateAdoptionContext.for_owner(Owner(optimizer, **overrides), state_dict=state_dict)


def registry_of(*adopters: Any) -> StateAdopterRegistry:
    """A registry without entry-point discovery holding exactly ``adopters``, in order."""
    registry = StateAdopterRegistry(entry_point_group=None)
    for adopter in adopters:
        registry.register(adopter)
    return registry


def load_through(
    optimizer: torch.optim.Optimizer,
    state_dict: Any,
    registry: StateAdopterRegistry,
    **owner_fields: Any,
) -> StateAdoptionOutcome:
    """Load ``state_dict`` into ``optimizer`` as a DistributedOptimizer would, via ``registry``."""
    owner = Owner(optimizer, **owner_fields)
    return load_inner_optimizer_state_dict(owner, state_dict, registry=registry)


def export_through(
    optimizer: torch.optim.Optimizer, registry: StateAdopterRegistry, **owner_fields: Any
) -> Dict[str, Any]:
    """Read ``optimizer``'s state dict as a DistributedOptimizer would, via ``registry``."""
    return export_inner_optimizer_state_dict(Owner(optimizer, **owner_fields), registry=registry)


def standin_registry(*adopters: Any) -> StateAdopterRegistry:
    """A registry without entry-point discovery holding ``adopters`` (default: the stand-in one)."""
    registry = StateAdopterRegistry(entry_point_group=None)
    for adopter in adopters or (standin_adopter(),):
        registry.register(adopter)
    return registry


def standin_adopter(param_device_type: str = "cpu") -> TEFusedAdamFP32StateAdopter:
    """The default adopter, recognising the stand-in instead of TE's FusedAdam."""
    return TEFusedAdamFP32StateAdopter(
        fused_adam_class=FusedAdamStandIn, param_device_type=param_device_type
    )


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

