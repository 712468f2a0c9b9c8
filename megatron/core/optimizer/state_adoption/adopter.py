"""The state adopter protocol and the context an adopter is given.

A *state adopter* installs an inner optimizer's state while a ``DistributedOptimizer``
loads a checkpoint, instead of the inner optimizer's own ``load_state_dict``. Its purpose
is to avoid work the own loader would do needlessly, e.g. allocating a second copy of
tensors that already have the exact dtype, device and shape the optimizer uses.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from megatron.core.distributed.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer.optimizer_config import OptimizerConfig


@dataclass(frozen=True)
class StateAdoptionContext:
    """Everything an adopter may inspect while an inner optimizer's state is loaded.

    Attributes:
        optimizer (torch.optim.Optimizer): the inner optimizer (e.g. Transformer Engine's
            FusedAdam) whose state is being loaded.
        state_dict (Mapping[str, Any]): the assembled ``{"state", "param_groups"}`` dict, in
            the format of ``torch.optim.Optimizer.state_dict()``. Adopters must neither
            mutate it nor write into its tensors.
        config (OptimizerConfig, optional): the owning optimizer's config; None when the
            state is loaded without an owner.
        ddp_config (DistributedDataParallelConfig, optional): the config of the owner's
            model chunks; None when unknown.
        is_stub_optimizer (bool): True when the owner is a stub without real parameters.
    """

    optimizer: torch.optim.Optimizer
    state_dict: Mapping[str, Any]
    config: Optional["OptimizerConfig"] = None
    ddp_config: Optional["DistributedDataParallelConfig"] = None
    is_stub_optimizer: bool = False

    @classmethod
    def for_owner(cls, owner: Any, state_dict: Mapping[str, Any]) -> "StateAdoptionContext":
        """Build the context for the inner optimizer of ``owner``.

        Args:
            owner (Any): a ``DistributedOptimizer`` (anything with an ``optimizer``
                attribute; ``config``, ``ddp_config`` and ``is_stub_optimizer`` are read
                when present).
            state_dict (Mapping[str, Any]): the assembled inner state dict.

        Returns:
            StateAdoptionContext: the context handed to every adopter.
        """
        return cls(
            optimizer=owner.optimizer,
            state_dict=state_dict,
            config=getattr(owner, "config", None),
            ddp_config=getattr(owner, "ddp_config", None),
            is_stub_optimizer=bool(getattr(owner, "is_stub_optimizer", False)),
        )


@runtime_checkable
class StateAdopter(Protocol):
    """Installs an inner optimizer's state in place of the optimizer's own loader.

    Contract:
        * ``decline_reason`` is side-effect free: it reads the context and returns None to
          accept or a human-readable reason to decline. If it raises, the adopter counts as
          declining.
        * ``adopt`` is only called after ``decline_reason`` accepted the same context. It
          must validate everything before it changes the optimizer, then install all of
          the state (all-or-nothing). If it raises anyway, the optimizer's previous
          ``state`` and ``param_groups`` are restored and the optimizer's own
          ``load_state_dict`` runs instead.
        * Both may be called from any rank and must not communicate.
    """

    name: str

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        """Decide whether this adopter can install ``context.state_dict``.

        Args:
            context (StateAdoptionContext): the optimizer and the incoming state.

        Returns:
            Optional[str]: None to accept, otherwise why the adopter declines.
        """
        ...

    def adopt(self, context: StateAdoptionContext) -> int:
        """Install ``context.state_dict`` into ``context.optimizer``.

        Args:
            context (StateAdoptionContext): the optimizer and the incoming state.

        Returns:
            int: bytes of memory the optimizer's own loader would have allocated and this
            adoption did not.
        """
        ...
