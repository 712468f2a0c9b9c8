"""The state adopter interface and the context its roles are given."""

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

import torch

if TYPE_CHECKING:
    from megatron.core.distributed.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

__all__ = ["AdoptionContext", "StateAdopter"]


@dataclass(frozen=True, kw_only=True)
class AdoptionContext:
    """What an adopter is told about one call.

    Attributes:
        optimizer (torch.optim.Optimizer): the inner optimizer, e.g. TE's FusedAdam.
        config (OptimizerConfig, optional): the owner's config.
        ddp_config (DistributedDataParallelConfig, optional): the owner's DDP config; None for
            the non-distributed optimizers.
        is_stub_optimizer (bool): whether the owner is a stub without parameters.
        state_dict (Mapping[str, Any], optional): the dict to install (load role only); neither
            it nor its tensors may be written to.
        owns_state_dict (bool): whether the call site built the dict and its tensors, so that
            nobody else holds them; otherwise only tensors the optimizer holds already may be
            installed by reference (the caller may keep and reuse the others).
    """

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

    Subclasses set ``name`` and implement the load role; the export, initialize and read roles
    decline with "not offered" unless overridden. Every check is side-effect free, may run on any
    rank and must not communicate; it returns None to accept or a reason to decline, and one
    that raises declines. An action runs only after its check accepted the same context and is
    checked against what the own code gives; if it raises or does not match, the optimizer is
    restored and the own code runs (a strict registry raises ``RuntimeError``). No role is
    offered an optimizer with hooks for, or an instance attribute of, the method it stands in for.
    """

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
