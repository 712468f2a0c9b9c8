"""An instance-level ``load_state_dict`` on each inner FusedAdam, as a third-party shim sets one.

Megatron-Bridge 0.6.2 wraps checkpoint loading in a context manager that gives each eligible
inner Transformer Engine ``FusedAdam`` *instance* its own ``load_state_dict``, which runs only
``torch.optim.Optimizer.load_state_dict`` (tensors installed by reference, TE's allocate-and-copy
skipped). ``--instance-loader bridge-like`` emulates that situation with this module's own
loader: in each resume worker (both sides), before the load, :func:`installed_instance_loaders`
sets such a method (``types.MethodType`` on the instance) on the inner optimizer of every
DistributedOptimizer, counts its calls, and removes it after the load.

Upstream calls ``optimizer.load_state_dict(...)``, which finds the instance's method. The build
must not let an adopter install the state of such an instance (the method is the caller's
business) and must call it, exactly once per load; its outcomes name that method as what ran.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from benchmarks.resume_benchmark.cases import INSTANCE_LOADERS

_METHOD: Final = "load_state_dict"


@dataclass
class InstanceLoaders:
    """The instance-level loaders of one load: their kind and how often each ran."""

    kind: str
    optimizers: list[str]
    calls: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """JSON form for the worker's result (``calls``: over all inner optimizers)."""
        return {
            "kind": self.kind,
            "optimizers": self.optimizers,
            "calls_per_optimizer": list(self.calls),
            "calls": sum(self.calls),
        }


def eligibility_problem(optimizer: torch.optim.Optimizer) -> str | None:
    """Why a bridge-like loader must not replace ``optimizer``'s own, or None.

    PyTorch's loader alone is correct only for FP32 moments without TE master weights (the
    state FusedAdam uses as it is); anything else needs TE's conversion.
    """
    dtypes = getattr(optimizer, "name_to_dtype_map", None)
    if not isinstance(dtypes, dict) or getattr(optimizer, "master_weights", None) is not False:
        return f"{type(optimizer).__name__} is not a FusedAdam without master weights"
    if any(dtypes.get(key) != torch.float32 for key in ("exp_avg", "exp_avg_sq")):
        return f"{type(optimizer).__name__} keeps non-FP32 moments ({dtypes})"
    if _METHOD in vars(optimizer):
        return f"{type(optimizer).__name__} already has an instance-level {_METHOD}"
    return None


def _counting_loader(
    loaders: InstanceLoaders, index: int
) -> Callable[[torch.optim.Optimizer, dict[str, Any]], None]:
    def load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """PyTorch's loader only (tensors by reference); counted."""
        loaders.calls[index] += 1
        torch.optim.Optimizer.load_state_dict(self, state_dict)

    return load_state_dict


@contextmanager
def installed_instance_loaders(
    kind: str | None, optimizers: Sequence[torch.optim.Optimizer]
) -> Iterator[InstanceLoaders | None]:
    """Give every optimizer an instance-level ``load_state_dict`` of ``kind`` for the block.

    ``kind`` None: nothing is installed and None is yielded. Raises ``ValueError`` for an
    unknown kind or an ineligible optimizer (before installing anything). The methods are
    removed on exit, also when the block raises.
    """
    if kind is None:
        yield None
        return
    if kind not in INSTANCE_LOADERS:
        raise ValueError(f"unknown instance loader {kind!r}; known: {', '.join(INSTANCE_LOADERS)}")
    problems = [p for p in map(eligibility_problem, optimizers) if p is not None]
    if problems or not optimizers:
        raise ValueError(f"cannot install {kind} instance loaders: {'; '.join(problems) or 'no optimizer'}")
    loaders = InstanceLoaders(kind, [type(o).__name__ for o in optimizers], [0] * len(optimizers))
    installed = []
    try:
        for index, optimizer in enumerate(optimizers):
            method = types.MethodType(_counting_loader(loaders, index), optimizer)
            setattr(optimizer, _METHOD, method)
            installed.append((optimizer, method))
        yield loaders
    finally:
        for optimizer, method in installed:
            if vars(optimizer).get(_METHOD) is method:
                delattr(optimizer, _METHOD)
