"""Optimizer-state adoption for Megatron-Core's checkpoint loading.

Wherever Megatron-Core hands loaded state to an inner optimizer -- ``DistributedOptimizer``
(both when it builds the scaffold for a sharded checkpoint and after the checkpoint was read,
and in its Megatron-FSDP branch) and the non-distributed ``Float16OptimizerWithFloat16Params``
and ``FP32Optimizer`` -- it hands the ``{"state", "param_groups"}`` dict to
:func:`load_inner_optimizer_state_dict`; ``DistributedOptimizer`` also reads the inner state
dict through :func:`export_inner_optimizer_state_dict`, and Megatron-FSDP creates the state it
reads into through :func:`initialize_inner_optimizer_state`. The first registered
:class:`StateAdopter` that accepts installs the state (and, if it is also a
:class:`StateExporter` or a :class:`StateInitializer`, may supply the state dict or create the
state); otherwise the optimizer's own code runs unchanged. A precision-aware
``DistributedOptimizer`` builds its ``dp_reshardable`` sharded state dict for loading inside
:func:`reading_optimizer_state`, takes each tensor to read into from
:func:`unscaled_state_or_read_target` (a :class:`StateReadTargetProvider` may supply the held
tensors themselves) and stores the read values with :func:`store_read_optimizer_state`. Each call's
:class:`StateAdoptionOutcome` goes to the hooks registered with
:func:`register_outcome_hook`.

Registered by default: the ``te_fused_adam_fp32`` adopter
(:class:`~.te_fused_adam.TEFusedAdamFP32StateAdopter`), which installs FP32 Adam moments
into Transformer Engine's FusedAdam by reference instead of letting TE allocate a second copy
(8 bytes per parameter of transient memory). ``OptimizerConfig.optimizer_state_adoption =
False`` (Megatron-LM: ``--no-optimizer-state-adoption``) switches all adoption off; for the
drop-in build, ``MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION=1`` does too, and
``MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS=name,...`` skips the named adopters.
"""

from .adopter import (
    StateAdopter,
    StateAdoptionContext,
    StateExportContext,
    StateExporter,
    StateInitializer,
    StateReadTargetProvider,
)
from .loader import (
    export_inner_optimizer_state_dict,
    initialize_inner_optimizer_state,
    load_inner_optimizer_state_dict,
    reading_optimizer_state,
    store_read_optimizer_state,
    unscaled_state_or_read_target,
)
from .outcome import StateAdoptionOutcome
from .registry import (
    StateAdopterRegistration,
    StateAdopterRegistry,
    register_outcome_hook,
    register_state_adopter,
    registered_state_adopters,
)

__all__ = [
    "StateAdopter",
    "StateAdopterRegistration",
    "StateAdopterRegistry",
    "StateAdoptionContext",
    "StateAdoptionOutcome",
    "StateExportContext",
    "StateExporter",
    "StateInitializer",
    "StateReadTargetProvider",
    "export_inner_optimizer_state_dict",
    "initialize_inner_optimizer_state",
    "load_inner_optimizer_state_dict",
    "reading_optimizer_state",
    "register_outcome_hook",
    "register_state_adopter",
    "registered_state_adopters",
    "store_read_optimizer_state",
    "unscaled_state_or_read_target",
]
