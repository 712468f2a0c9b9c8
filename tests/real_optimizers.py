"""Real ``torch.optim`` optimizers with populated state, for the loader's behaviour tests.

Every builder is deterministic: two calls give optimizers with the same parameter values and
bitwise-equal state, so one can be loaded with the loader and the other with the optimizer's
own method and the results compared. Parameters 0 and 2 have the same shape, so a state dict
can permute their state without any shape check noticing.
"""

from typing import Any, Callable, Dict, List

import torch

SHAPES = [(6,), (2, 3), (6,), (5,)]


def make_params(seed: int = 7) -> List[torch.nn.Parameter]:
    """FP32 CPU parameters of ``SHAPES``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _two_groups(params: List[torch.nn.Parameter]) -> List[Dict[str, Any]]:
    return [{"params": params[:2]}, {"params": params[2:], "lr": 0.5}]


def fresh_adam() -> torch.optim.Adam:
    """An Adam with two param groups of different learning rates and no state."""
    return torch.optim.Adam(_two_groups(make_params()), lr=1e-3)


def fresh_sgd() -> torch.optim.SGD:
    """An SGD with momentum, two param groups and no state."""
    return torch.optim.SGD(_two_groups(make_params()), lr=0.1, momentum=0.9)


def trained(make: Callable[[], torch.optim.Optimizer], steps: int = 2) -> torch.optim.Optimizer:
    """``make()`` after ``steps`` steps with deterministic gradients."""
    optimizer = make()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    generator = torch.Generator().manual_seed(11)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return optimizer


def trained_adam() -> torch.optim.Adam:
    """``fresh_adam()`` after two steps: per parameter a 0-d ``step``, ``exp_avg``, ``exp_avg_sq``."""
    optimizer = trained(fresh_adam)
    assert isinstance(optimizer, torch.optim.Adam)
    return optimizer


def trained_sgd() -> torch.optim.SGD:
    """``fresh_sgd()`` after two steps: per parameter a ``momentum_buffer``."""
    optimizer = trained(fresh_sgd)
    assert isinstance(optimizer, torch.optim.SGD)
    return optimizer


def cloned(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """``state_dict`` with every state tensor cloned: a checkpoint's payload, owned by the caller."""
    return {
        "state": {
            key: {
                name: value.clone() if isinstance(value, torch.Tensor) else value
                for name, value in entry.items()
            }
            for key, entry in state_dict["state"].items()
        },
        "param_groups": [dict(group, params=list(group["params"])) for group in state_dict["param_groups"]],
    }


def params_of(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every parameter, group by group, in PyTorch's state-dict order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every state tensor the optimizer holds."""
    return sum(
        value.nbytes
        for entry in optimizer.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    )


def held_state(optimizer: torch.optim.Optimizer) -> List[tuple]:
    """(parameter position, key, value) of every state entry; compare values with ``is``."""
    positions = {id(p): index for index, p in enumerate(params_of(optimizer))}
    return sorted(
        (positions[id(param)], key, value)
        for param, entry in optimizer.state.items()
        for key, value in entry.items()
    )


def groups_without_params(optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """The param groups' hyper-parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def assert_same_state(mine: torch.optim.Optimizer, theirs: torch.optim.Optimizer) -> None:
    """Same state keys per parameter, bitwise-equal tensors, equal hyper-parameters."""
    my_state, their_state = held_state(mine), held_state(theirs)
    assert [entry[:2] for entry in my_state] == [entry[:2] for entry in their_state]
    for (position, key, a), (_, _, b) in zip(my_state, their_state):
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (position, key)
        else:
            assert a == b, (position, key)
    assert groups_without_params(mine) == groups_without_params(theirs)


def assert_unchanged(optimizer: torch.optim.Optimizer, state_before: List[tuple], groups_before: List[Dict[str, Any]]) -> None:
    """The optimizer holds the very tensors of ``state_before`` and the hyper-parameters of ``groups_before``."""
    after = held_state(optimizer)
    assert [entry[:2] for entry in after] == [entry[:2] for entry in state_before]
    assert all(a[2] is b[2] for a, b in zip(after, state_before))
    assert groups_without_params(optimizer) == groups_before
