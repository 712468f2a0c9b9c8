"""The state adopter protocols and the contexts an adopter is given.

A *state adopter* installs an inner optimizer's state while a ``DistributedOptimizer`` loads
a checkpoint, instead of the inner optimizer's own ``load_state_dict``. Its purpose is to
avoid work the own loader would do needlessly, e.g. allocating a second copy of tensors that
already have the exact dtype, device and shape the optimizer uses.

An adopter may also be a *state exporter*: it then supplies the inner state dict that
``DistributedOptimizer.load_state_dict`` works from, instead of the inner optimizer's own
``state_dict()``, e.g. the held state tensors as they are instead of FP32 copies of them.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Protocol, Tuple, runtime_checkable

import torch

if TYPE_CHECKING:
    from megatron.core.distributed.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

__all__ = ["StateAdopter", "StateAdoptionContext", "StateExportContext", "StateExporter"]


@dataclass(frozen=True)
class StateExportContext:
    """What an exporter may inspect when ``DistributedOptimizer.load_state_dict`` begins.

    Attributes:
        optimizer (torch.optim.Optimizer): the inner optimizer whose state dict is needed.
        config (OptimizerConfig, optional): the owning optimizer's config; None when the
            state is exported without an owner.
        ddp_config (DistributedDataParallelConfig, optional): the config of the owner's
            model chunks; None when unknown.
        is_stub_optimizer (bool): True when the owner is a stub without real parameters.
    """

    optimizer: torch.optim.Optimizer
    config: Optional["OptimizerConfig"] = None
    ddp_config: Optional["DistributedDataParallelConfig"] = None
    is_stub_optimizer: bool = False

    @classmethod
    def for_owner(cls, owner: Any) -> "StateExportContext":
        """Build the context for the inner optimizer of ``owner``.

        Args:
            owner (Any): a ``DistributedOptimizer`` (anything with an ``optimizer``
                attribute; ``config``, ``ddp_config`` and ``is_stub_optimizer`` are read
                when present).

        Returns:
            StateExportContext: the context handed to every exporter.
        """
        return cls(
            optimizer=owner.optimizer,
            config=getattr(owner, "config", None),
            ddp_config=getattr(owner, "ddp_config", None),
            is_stub_optimizer=bool(getattr(owner, "is_stub_optimizer", False)),
        )


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
            owner (Any): a ``DistributedOptimizer`` (see :meth:`StateExportContext.for_owner`).
            state_dict (Mapping[str, Any]): the assembled inner state dict.

        Returns:
            StateAdoptionContext: the context handed to every adopter.
        """
        export_context = StateExportContext.for_owner(owner)
        return cls(
            optimizer=export_context.optimizer,
            state_dict=state_dict,
            config=export_context.config,
            ddp_config=export_context.ddp_config,
            is_stub_optimizer=export_context.is_stub_optimizer,
        )


@runtime_checkable
class StateAdopter(Protocol):
    """Installs an inner optimizer's state in place of the optimizer's own loader.

    Contract:
        * ``name`` is unique among the registered adopters.
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


@runtime_checkable
class StateExporter(Protocol):
    """Supplies the inner state dict in place of the optimizer's own ``state_dict()``.

    A registered adopter that also implements these methods is consulted where
    ``DistributedOptimizer.load_state_dict`` reads the inner optimizer's state dict.

    Contract:
        * ``export_decline_reason`` is side-effect free, like ``decline_reason``.
        * ``export_state_dict`` changes nothing. The dict it returns must be
          interchangeable with ``optimizer.state_dict()`` for that caller: the same
          ``param_groups``, and per parameter state values that every loader (the
          optimizer's own and any adopter) turns into the same bits. If it raises or
          returns a malformed dict, the optimizer's own ``state_dict()`` is used.
        * Both may be called from any rank and must not communicate.
    """

    name: str

    def export_decline_reason(self, context: StateExportContext) -> Optional[str]:
        """Decide whether this exporter can supply the state dict of ``context.optimizer``.

        Args:
            context (StateExportContext): the optimizer and its owner's configs.

        Returns:
            Optional[str]: None to accept, otherwise why the exporter declines.
        """
        ...

    def export_state_dict(self, context: StateExportContext) -> Tuple[Dict[str, Any], int]:
        """Return the inner state dict of ``context.optimizer``.

        Args:
            context (StateExportContext): a context this exporter accepted.

        Returns:
            Tuple[Dict[str, Any], int]: the ``{"state", "param_groups"}`` dict, and the bytes
            the optimizer's own ``state_dict()`` would have allocated and this export did not.
        """
        ...
