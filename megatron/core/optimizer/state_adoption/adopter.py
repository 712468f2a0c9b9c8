# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""The state adopter interface and the context its roles are given."""

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Mapping, Optional, Tuple

import torch

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.optimizer import MegatronOptimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig


@dataclass(frozen=True)
class AdoptionContext:
    """What a state adopter is told about one call.

    Attributes:
        optimizer (torch.optim.Optimizer): the inner optimizer, e.g. TE's FusedAdam.
        config (OptimizerConfig, optional): the owning Megatron optimizer's config.
        ddp_config (DistributedDataParallelConfig, optional): the owner's DDP config; None for
            the non-distributed optimizers.
        is_stub_optimizer (bool): the owner holds no parameters on this rank.
        state_dict (Mapping, optional): for a load, the state dict to install. Neither it nor its
            tensors may be written to.
        owns_state_dict (bool): the call site built the state dict and its tensors, so that
            nobody else holds them and they may be installed by reference. Otherwise the caller
            may keep the tensors the optimizer does not hold already.
    """

    optimizer: torch.optim.Optimizer
    config: Optional["OptimizerConfig"] = None
    ddp_config: Optional["DistributedDataParallelConfig"] = None
    is_stub_optimizer: bool = False
    state_dict: Optional[Mapping[str, Any]] = None
    owns_state_dict: bool = False

    @classmethod
    def for_owner(
        cls,
        owner: "MegatronOptimizer",
        state_dict: Optional[Mapping[str, Any]] = None,
        owns_state_dict: bool = False,
    ) -> "AdoptionContext":
        """Returns the context of the inner optimizer of ``owner``, a Megatron optimizer."""
        return cls(
            optimizer=owner.optimizer,
            config=getattr(owner, "config", None),
            ddp_config=getattr(owner, "ddp_config", None),
            is_stub_optimizer=bool(getattr(owner, "is_stub_optimizer", False)),
            state_dict=state_dict,
            owns_state_dict=owns_state_dict,
        )


class StateAdopter(abc.ABC):
    """Does what an inner optimizer's own code does with checkpoint state, without its copies.

    Subclasses set :attr:`name` and implement the load role (:meth:`decline_reason` and
    :meth:`adopt`); the other roles decline unless overridden. A check (``*_decline_reason``)
    changes nothing and communicates with no other rank; it returns None to accept, or the
    reason it declines. An action runs only after its check accepted, and its result is checked
    against what the own code would give; if it raises or its result does not match, the
    optimizer is restored and the own code runs (a strict registry raises instead).

    An install keeps the incoming tensors themselves: each state tensor it leaves is the state
    dict's tensor (same memory, dtype, shape and device), unwritten. What an adopter cannot
    install by reference, it declines.
    """

    #: Attributes of the inner optimizer besides ``state`` and ``param_groups`` that
    #: :meth:`adopt` may change (e.g. FusedAdam's ``_scales``). A change to any other fails the
    #: result check.
    installed_attributes: ClassVar[Tuple[str, ...]] = ()

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Unique name: a letter, then letters, digits, ``_``, ``.`` or ``-``."""

    @abc.abstractmethod
    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Checks whether to install ``context.state_dict`` instead of ``load_state_dict``.

        Args:
            context (AdoptionContext): the load; ``context.state_dict`` is set.

        Returns:
            Optional[str]: None to accept, otherwise why the adopter declines.
        """

    @abc.abstractmethod
    def adopt(self, context: AdoptionContext) -> None:
        """Installs ``context.state_dict`` into ``context.optimizer``, all or nothing."""

    def export_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Checks whether to export the state dict instead of ``optimizer.state_dict()``."""
        return "it offers no export"

    def export_state_dict(self, context: AdoptionContext) -> Dict[str, Any]:
        """Returns PyTorch's state dict of the optimizer, holding its state tensors themselves."""
        raise NotImplementedError

    def initialize_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Checks whether to create the state a checkpoint is read into (:meth:`initialize`)."""
        return "it offers no initialization"

    def initialize(self, context: AdoptionContext) -> None:
        """Creates every parameter's state before a checkpoint is read into it.

        Upstream creates it parameter by parameter (Megatron-FSDP's dummy step, ``init_state_fn``,
        the distributed optimizer's placeholders), each tensor its own allocation. The state
        created here must be what the adopter's load accepts as a state dict the call site owns
        (:meth:`decline_reason`), its values the inner optimizer's own initial ones (zeroed
        moments). Where upstream's initialization is a step (Megatron-FSDP's), the inner
        optimizer's own step without gradients follows, so that the read fills the groups' keys,
        ``step`` included.
        """
        raise NotImplementedError

    def read_target_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Checks whether to supply the tensors a checkpoint is read into (once per read)."""
        return "it offers no read targets"

    def read_target(self, context: AdoptionContext, param: torch.Tensor, name: str) -> torch.Tensor:
        """Returns the tensor that state ``name`` of ``param`` is read into.

        Args:
            context (AdoptionContext): the read.
            param (torch.Tensor): the parameter whose state is read.
            name (str): the state's name, e.g. ``"exp_avg"``.

        Returns:
            torch.Tensor: the held tensor itself where reading into it gives the bits
            ``set_scaled_state`` stores, else new memory of the dtype ``get_unscaled_state``
            returns.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
