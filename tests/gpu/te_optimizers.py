"""Helpers for the GPU tests that drive real Transformer Engine FusedAdam optimizers."""

from typing import List

import torch


def params_of(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every parameter of ``optimizer``, in group order."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def random_step(optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One optimizer step with seeded random gradients in each parameter's dtype."""
    generator = torch.Generator(device="cuda").manual_seed(100 + seed)
    for param in params_of(optimizer):
        param.grad = torch.randn(param.shape, generator=generator, device="cuda").to(param.dtype)
    optimizer.step()


def bitwise_equal(left: List[torch.Tensor], right: List[torch.Tensor]) -> bool:
    """Whether two tensor lists hold the same dtypes, shapes and bytes."""
    return len(left) == len(right) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(left, right)
    )


def state_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every state tensor, in parameter order then key order."""
    return [optimizer.state[p][k] for p in params_of(optimizer) for k in sorted(optimizer.state[p])]
