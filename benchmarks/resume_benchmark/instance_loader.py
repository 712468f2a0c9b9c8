"""An instance-level ``load_state_dict`` on each inner FusedAdam, as a third-party shim sets one.

Megatron-Bridge 0.6.2 gives each eligible inner TE ``FusedAdam`` instance a ``load_state_dict``
that runs only ``torch.optim.Optimizer.load_state_dict`` (tensors by reference, TE's
allocate-and-copy skipped). ``--instance-loader bridge-like`` emulates it: for each resume,
:func:`installed_instance_loaders` sets such a method, counting its calls, on every inner
optimizer. The build must call it exactly once per load and not let an adopter install that state.
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
    """Why ``optimizer`` must keep its own loader (PyTorch's alone would be wrong), or None."""
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

    ``kind`` None yields None. Raises ``ValueError`` for an unknown kind or an ineligible
    optimizer before installing anything; the methods are removed on exit.
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
