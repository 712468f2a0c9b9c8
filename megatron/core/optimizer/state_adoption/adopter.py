"""The state adopter interface and the context its roles are given."""

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

import torch

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.optimizer_config import OptimizerConfig


@dataclass(frozen=True, kw_only=True)
class AdoptionContext:
    """What an adopter is told about one call: the inner ``optimizer`` (e.g. TE's FusedAdam),
    its owner's ``config``, ``ddp_config`` (None for the non-distributed optimizers) and
    ``is_stub_optimizer``; for a load the ``state_dict`` to install (neither it nor its tensors
    may be written to) and ``owns_state_dict``: whether the call site built the dict and its
    tensors, so that nobody else holds them (otherwise the caller may keep and reuse the tensors
    the optimizer does not hold already, which TE's loader copies)."""

    optimizer: torch.optim.Optimizer
    config: Optional["OptimizerConfig"] = None
    ddp_config: Optional["DistributedDataParallelConfig"] = None
    is_stub_optimizer: bool = False
    state_dict: Optional[Mapping[str, Any]] = None
    owns_state_dict: bool = False

    @classmethod
    def for_owner(cls, owner: Any, **fields: Any) -> "AdoptionContext":
        """The context of a Megatron optimizer's (``owner``'s) inner optimizer; ``fields`` are
        a load's ``state_dict`` and ``owns_state_dict``."""
        return cls(
            optimizer=owner.optimizer,
            config=getattr(owner, "config", None),
            ddp_config=getattr(owner, "ddp_config", None),
            is_stub_optimizer=bool(getattr(owner, "is_stub_optimizer", False)),
            **fields,
        )


class StateAdopter(abc.ABC):
    """Does what the inner optimizer's own code does with loaded state, without its waste.
    Subclasses set ``name`` and the load role; the others decline ("not offered") unless
    overridden. A check is side-effect free, runs on any rank without communicating and returns
    None to accept or a reason (raising declines). An action runs only after its check accepted
    and is checked against what the own code gives; if it raises or does not match, the optimizer
    is restored and the own code runs (a strict registry raises). No role sees an optimizer with
    hooks for, or an instance attribute of, the method it stands in for."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Unique name: a letter, then letters, digits, ``_``, ``.`` or ``-``."""

    @abc.abstractmethod
    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """None to install ``context.state_dict`` instead of ``optimizer.load_state_dict``,
        otherwise why not."""

    @abc.abstractmethod
    def adopt(self, context: AdoptionContext) -> None:
        """Install ``context.state_dict`` (all or nothing) into the optimizer."""

    def export_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Whether to export the state dict instead of ``optimizer.state_dict()``."""
        return "it offers no export"

    def export_state_dict(self, context: AdoptionContext) -> Dict[str, Any]:
        """PyTorch's state dict of the optimizer, with the held tensors themselves."""
        raise NotImplementedError

    def initialize_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Whether ``optimizer.step()`` without gradients creates the complete state a checkpoint
        is read into, so that Megatron-FSDP's dummy step needs no zero gradients."""
        return "it offers no initialization"

    def read_target_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Whether to supply the tensors a checkpoint is read into (asked once per read)."""
        return "it offers no read targets"

    def read_target(self, context: AdoptionContext, param: torch.Tensor, name: str) -> torch.Tensor:
        """The tensor state ``name`` of ``param`` is read into: the held tensor itself where
        reading into it gives the bits ``set_scaled_state`` stores, else new memory of the dtype
        ``get_unscaled_state`` returns."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
