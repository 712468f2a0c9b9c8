"""The state adopter, exporter and initializer protocols, and the contexts they are given.

A *state adopter* installs an inner optimizer's state while a Megatron optimizer (a
``DistributedOptimizer``, with or without Megatron-FSDP, or a non-distributed
``Float16OptimizerWithFloat16Params`` or ``FP32Optimizer``) loads a checkpoint, instead of the
inner optimizer's own ``load_state_dict``. Its purpose is to avoid work the own loader would do
needlessly, e.g. allocating a second copy of tensors that already have the exact dtype, device
and shape the optimizer uses.

A *state exporter* (an adopter that also implements :class:`StateExporter`) supplies the inner
state dict that ``DistributedOptimizer.load_state_dict`` starts from, instead of the inner
optimizer's own ``state_dict()``: the state as the optimizer holds it, where the own method
would return converted copies.

A *state initializer* (an adopter that also implements :class:`StateInitializer`) creates the
state a Megatron-FSDP checkpoint is read into, instead of Megatron-FSDP's dummy step on zero
gradients.

A *read-target provider* (an adopter that also implements :class:`StateReadTargetProvider`)
supplies the tensors a precision-aware ``DistributedOptimizer`` reads a ``dp_reshardable``
checkpoint into, instead of the unscaled FP32 copies of its state (``get_unscaled_state``).
"""

from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    Mapping,
    Optional,
    Protocol,
    Type,
    TypeVar,
    runtime_checkable,
)

import torch

if TYPE_CHECKING:
    from megatron.core.distributed.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

__all__ = [
    "StateAdopter",
    "StateAdoptionContext",
    "StateExportContext",
    "StateExporter",
    "StateInitializer",
    "StateReadTargetProvider",
]

_Context = TypeVar("_Context", bound="StateExportContext")


@dataclass(frozen=True, kw_only=True)
class StateExportContext:
    """The inner optimizer and what is known of its owner, at either hook point.

    Attributes:
        optimizer (torch.optim.Optimizer): the inner optimizer (e.g. Transformer Engine's
            FusedAdam).
        config (OptimizerConfig, optional): the owner's config; None without an owner.
        ddp_config (DistributedDataParallelConfig, optional): the config of the owner's
            model chunks; None for an owner without one (the non-distributed optimizers).
        is_stub_optimizer (bool): True when the owner is a stub without real parameters.
    """

    optimizer: torch.optim.Optimizer
    config: Optional["OptimizerConfig"] = None
    ddp_config: Optional["DistributedDataParallelConfig"] = None
    is_stub_optimizer: bool = False

    @classmethod
    def for_owner(cls: Type[_Context], owner: Any, **fields: Any) -> _Context:
        """Build the context for the inner optimizer of ``owner``.

        Args:
            owner (Any): a Megatron optimizer (anything with an ``optimizer`` attribute; ``config``, ``ddp_config`` and ``is_stub_optimizer`` are read
                when present).
            **fields (Any): the fields of a subclass, e.g. ``state_dict``.

        Returns:
            StateExportContext: the context (of the class it is called on) handed to every
            adopter or exporter.
        """
        return cls(
            optimizer=owner.optimizer,
            config=getattr(owner, "config", None),
            ddp_config=getattr(owner, "ddp_config", None),
            is_stub_optimizer=bool(getattr(owner, "is_stub_optimizer", False)),
            **fields,
        )


@dataclass(frozen=True, kw_only=True)
class StateAdoptionContext(StateExportContext):
    """An export context plus the state dict to install.

    Attributes:
        state_dict (Mapping[str, Any]): the assembled ``{"state", "param_groups"}`` dict, in
            the format of ``torch.optim.Optimizer.state_dict()``. Adopters must neither
            mutate it nor write into its tensors.
    """

    state_dict: Mapping[str, Any]


@runtime_checkable
class StateAdopter(Protocol):
    """Installs an inner optimizer's state in place of the optimizer's own loader.

    Contract:
        * ``name`` is unique among the registered adopters: letters, digits, ``_``, ``.``
          and ``-``, starting with a letter (it is what disables the adopter by name).
        * ``decline_reason`` is side-effect free: it reads the context and returns None to
          accept or a human-readable reason to decline. If it raises, the adopter counts as
          declining.
        * ``adopt`` is only called after ``decline_reason`` accepted the same context. It
          must validate everything before it changes the optimizer, then install all of
          the state (all-or-nothing). If it raises anyway, the optimizer's previous
          ``state`` and ``param_groups`` are restored and the optimizer's own
          ``load_state_dict`` runs instead.
        * Neither is offered an optimizer with ``load_state_dict`` hooks or with a
          ``load_state_dict`` set on the instance: those always get the own loader.
        * Both may be called from any rank and must not communicate.

    What an adoption saved is measured, not claimed: after the install, the loader counts
    the state bytes that are tensors which existed before the call (installed by reference)
    and those that were newly allocated.
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

    def adopt(self, context: StateAdoptionContext) -> None:
        """Install ``context.state_dict`` into ``context.optimizer``.

        Args:
            context (StateAdoptionContext): a context this adopter accepted.
        """
        ...


@runtime_checkable
class StateExporter(Protocol):
    """Supplies the inner state dict in place of the optimizer's own ``state_dict()``.

    A registered adopter that also implements these methods is consulted where
    ``DistributedOptimizer.load_state_dict`` reads the inner optimizer's state dict.

    Contract:
        * ``export_decline_reason`` is side-effect free, like ``decline_reason``.
        * ``export_state_dict`` changes nothing and returns PyTorch's state dict of the
          optimizer *as it holds its state*: the param groups and ids PyTorch assigns, and per
          parameter exactly the held keys, each tensor the held tensor itself (not a copy), so
          that every loader turns it into the same bits as the own ``state_dict()``. It is
          checked against the held state (same ids, groups, order, keys, shapes, dtypes,
          devices and storages); if it raises or does not match, the own ``state_dict()`` is
          used.
        * Neither is offered an optimizer with ``state_dict`` hooks or with a ``state_dict``
          set on the instance.
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

    def export_state_dict(self, context: StateExportContext) -> Dict[str, Any]:
        """Return the state dict of ``context.optimizer`` as it holds its state.

        Args:
            context (StateExportContext): a context this exporter accepted.

        Returns:
            Dict[str, Any]: the ``{"state", "param_groups"}`` dict.
        """
        ...


@runtime_checkable
class StateInitializer(Protocol):
    """Creates the inner optimizer's state for a checkpoint to be read into, in place of the
    owner's own initialisation.

    A registered adopter that also implements these methods is consulted where a Megatron-FSDP
    ``DistributedOptimizer`` builds its sharded state dict for loading (``fsdp_dtensor``):
    upstream creates the state there with a dummy ``step()`` on zero gradients, which holds a
    gradient for every parameter on top of the new state; ``torch.distributed.checkpoint`` then
    reads the checkpoint into that state in place.

    Contract:
        * ``initialize_decline_reason`` is side-effect free, like ``decline_reason``.
        * ``initialize_state`` gives every parameter the state entries the own initialisation
          gives it -- the same keys, dtypes, devices, shapes and layouts -- so that once the
          checkpoint is read in, the state is what the own path gives. It may skip what the
          read overwrites (values, the parameters) and must leave the param groups as they are,
          except ``step``, which a first step creates or advances as the own one does. If it raises, or leaves a parameter with a non-empty local
          shard without state, the optimizer's previous state and param groups are restored and
          the own initialisation runs.
        * Neither is offered an optimizer that already holds state, one with ``step`` hooks
          (its own or global ones), or one with a ``step`` set on the instance.
        * Both may be called from any rank and must not communicate.
    """

    name: str

    def initialize_decline_reason(self, context: StateExportContext) -> Optional[str]:
        """Decide whether this initializer can create the state of ``context.optimizer``.

        Args:
            context (StateExportContext): the optimizer and its owner's configs.

        Returns:
            Optional[str]: None to accept, otherwise why the initializer declines.
        """
        ...

    def initialize_state(self, context: StateExportContext) -> None:
        """Create the state of ``context.optimizer`` for a checkpoint to be read into.

        Args:
            context (StateExportContext): a context this initializer accepted.
        """
        ...


@runtime_checkable
class StateReadTargetProvider(Protocol):
    """Supplies the tensors a checkpoint's optimizer state is read into, in place of the
    unscaled FP32 copies the precision-aware ``DistributedOptimizer`` reads into.

    A registered adopter that also implements these methods is consulted where a
    precision-aware ``DistributedOptimizer`` builds its ``dp_reshardable`` sharded state dict for
    loading. Upstream calls the inner optimizer's ``get_unscaled_state(param, name)`` for every
    state tensor there: an FP32 copy of each BF16 (or scaled FP16/FP8) tensor, which the checkpoint
    is read into and which lives through the whole read; after the read, ``set_scaled_state``
    converts each into the held tensor.

    Contract:
        * ``read_target_decline_reason`` is side-effect free, like ``decline_reason``; it is
          asked once per sharded state dict, after the held state was created.
        * ``read_target(context, param, name)`` returns, for one state tensor, either the held
          tensor itself (its local shard), when reading the checkpoint's values straight into
          it gives the bits ``set_scaled_state`` would store (a plain cast: BF16, FP32 or int16
          remainders; never a scaled FP16 or FP8 state), or a new FP32 tensor of the held
          shape on the held device, which ``set_scaled_state`` converts after the read. A held
          tensor as target is overwritten by the read, also by a read that fails midway, so
          offer it only for state that holds nothing a user has yet (e.g. not after a step).
          A target that breaks these rules, or a raise, makes this and every later tensor of
          the sharded state dict fall back to ``get_unscaled_state``.
        * Neither is offered an owner with adoption switched off, nor an optimizer with
          ``get_unscaled_state`` or ``set_scaled_state`` set on the instance.
        * Both may be called from any rank and must not communicate.
    """

    name: str

    def read_target_decline_reason(self, context: StateExportContext) -> Optional[str]:
        """Decide whether this provider can supply the read targets of ``context.optimizer``.

        Args:
            context (StateExportContext): the optimizer and its owner's configs.

        Returns:
            Optional[str]: None to accept, otherwise why the provider declines.
        """
        ...

    def read_target(
        self, context: StateExportContext, param: torch.Tensor, name: str
    ) -> torch.Tensor:
        """Return the tensor the checkpoint's values of state ``name`` of ``param`` are read into.

        Args:
            context (StateExportContext): a context this provider accepted.
            param (torch.Tensor): the inner optimizer's parameter.
            name (str): the state's name, e.g. ``"exp_avg"`` or ``"master_param"``.

        Returns:
            torch.Tensor: the held tensor itself or a new FP32 tensor (see the contract).
        """
        ...
