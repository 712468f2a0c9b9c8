"""The state adopter interface and the context its roles are given.

A *state adopter* does, while a Megatron optimizer loads a checkpoint, what the inner optimizer's
own code would do, without the work that code does needlessly (e.g. Transformer Engine's
FusedAdam allocating a second copy of moments that already have its dtype, device and shape).
It has one required role and three optional ones, each a side-effect-free check (None to
accept, a reason to decline) and an action:

* load (required): ``decline_reason`` / ``adopt`` install a ``{"state", "param_groups"}`` dict
  instead of the inner optimizer's ``load_state_dict``;
* export: ``export_decline_reason`` / ``export_state_dict`` return the state dict as the
  optimizer holds it instead of its ``state_dict()`` (which may return converted copies);
* initialize: ``initialize_decline_reason`` accepts that the optimizer's own ``step()`` without
  gradients creates its complete state, instead of Megatron-FSDP's dummy step on zero gradients;
* read: ``read_target_decline_reason`` / ``read_target`` supply the tensors a precision-aware
  ``dp_reshardable`` checkpoint is read into instead of ``get_unscaled_state``'s FP32 copies.

Megatron-Core checks every result against what the own code would give and otherwise runs the
own code (see ``dispatch.py``).
"""

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
        config (OptimizerConfig, optional): the owner's config; None if it has none.
        ddp_config (DistributedDataParallelConfig, optional): the owner's DDP config; None for
            the non-distributed optimizers.
        is_stub_optimizer (bool): whether the owner is a stub without parameters.
        state_dict (Mapping[str, Any], optional): the dict to install (load role only). Adopters
            neither mutate it nor write into its tensors.
        owns_state_dict (bool): whether the call site built the state dict and its tensors, so
            that nobody else holds them. Otherwise only tensors the optimizer holds already may
            be installed by reference: the caller may keep and reuse the others.
    """

    optimizer: torch.optim.Optimizer
    config: Optional["OptimizerConfig"] = None
    ddp_config: Optional["DistributedDataParallelConfig"] = None
    is_stub_optimizer: bool = False
    state_dict: Optional[Mapping[str, Any]] = None
    owns_state_dict: bool = False

    @classmethod
    def for_owner(cls, owner: Any, **fields: Any) -> "AdoptionContext":
        """Build the context of ``owner``'s inner optimizer.

        Args:
            owner (Any): a Megatron optimizer (``optimizer`` is read; ``config``, ``ddp_config``
                and ``is_stub_optimizer`` where present).
            **fields (Any): ``state_dict`` and ``owns_state_dict`` for a load.

        Returns:
            AdoptionContext: the context.
        """
        return cls(
            optimizer=owner.optimizer,
            config=getattr(owner, "config", None),
            ddp_config=getattr(owner, "ddp_config", None),
            is_stub_optimizer=bool(getattr(owner, "is_stub_optimizer", False)),
            **fields,
        )


class StateAdopter(abc.ABC):
    """Base class of state adopters: subclass it, set ``name`` and implement the load role.

    Contract of every role: its check is side-effect free, may run on any rank and must not
    communicate; its action runs only after the check accepted the same context. A check that
    raises is a decline. An action is checked against what the own code gives; if it raises or
    its result does not match, the optimizer is restored and the own code runs (with a strict
    registry: ``RuntimeError``). An adopter never sees an optimizer with hooks for the method it
    stands in for, or with that method set on the instance: upstream would run those.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Unique name: a letter, then letters, digits, ``_``, ``.`` or ``-``."""

    @abc.abstractmethod
    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Decide whether to install ``context.state_dict``.

        Args:
            context (AdoptionContext): the optimizer and the incoming state dict.

        Returns:
            Optional[str]: None to accept, otherwise why not.
        """

    @abc.abstractmethod
    def adopt(self, context: AdoptionContext) -> None:
        """Install ``context.state_dict`` into ``context.optimizer``: validate first, then
        install all of it.

        Args:
            context (AdoptionContext): a context ``decline_reason`` accepted.
        """

    def export_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Decide whether to supply the state dict of ``context.optimizer``.

        Args:
            context (AdoptionContext): the optimizer.

        Returns:
            Optional[str]: None to accept, otherwise why not (by default: not offered).
        """
        return "it offers no export"

    def export_state_dict(self, context: AdoptionContext) -> Dict[str, Any]:
        """Return PyTorch's state dict of ``context.optimizer`` with the held tensors themselves.

        Args:
            context (AdoptionContext): a context ``export_decline_reason`` accepted.

        Returns:
            Dict[str, Any]: the ``{"state", "param_groups"}`` dict.
        """
        raise NotImplementedError(f"{self.name} offers no export")

    def initialize_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Decide whether ``context.optimizer.step()`` without gradients creates the complete
        state a checkpoint is read into (then Megatron-FSDP's zero gradients are not needed).

        Args:
            context (AdoptionContext): the optimizer, which holds no state.

        Returns:
            Optional[str]: None to accept, otherwise why not (by default: not offered).
        """
        return "it offers no initialization"

    def read_target_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Decide whether to supply the tensors a checkpoint is read into (asked once per read).

        Args:
            context (AdoptionContext): the optimizer, whose state exists already.

        Returns:
            Optional[str]: None to accept, otherwise why not (by default: not offered).
        """
        return "it offers no read targets"

    def read_target(self, context: AdoptionContext, param: torch.Tensor, name: str) -> torch.Tensor:
        """Return the tensor state ``name`` of ``param`` is read into: the held tensor itself
        where reading into it gives the bits ``set_scaled_state`` would store, or a new tensor
        of the dtype ``get_unscaled_state`` returns.

        Args:
            context (AdoptionContext): a context ``read_target_decline_reason`` accepted.
            param (torch.Tensor): the inner optimizer's parameter.
            name (str): the state's name.

        Returns:
            torch.Tensor: the read target.
        """
        raise NotImplementedError(f"{self.name} offers no read targets")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
