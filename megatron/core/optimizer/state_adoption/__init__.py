"""Optimizer-state adoption for ``DistributedOptimizer`` checkpoint loading.

While a ``DistributedOptimizer`` loads its inner optimizer's state (both when it builds the
scaffold for a sharded checkpoint and after the checkpoint was read), it hands the
assembled ``{"state", "param_groups"}`` dict to :func:`load_inner_optimizer_state_dict`.
The first registered :class:`StateAdopter` that accepts installs the state; otherwise the
inner optimizer's own ``load_state_dict`` runs unchanged.

Registered by default: :class:`TEFusedAdamFP32StateAdopter`, which installs FP32 Adam
moments into Transformer Engine's FusedAdam by reference instead of letting TE allocate a
second copy (8 bytes per parameter of transient memory). Set
``MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION=1`` to switch all adoption off.
"""

from .adopter import StateAdopter, StateAdoptionContext
from .loader import DISABLE_ENV_VAR, load_inner_optimizer_state_dict, state_adoption_disabled
from .registry import (
    ENTRY_POINT_GROUP,
    StateAdopterRegistry,
    default_registry,
    register_state_adopter,
    registered_state_adopters,
)
from .te_fused_adam import TEFusedAdamFP32StateAdopter

register_state_adopter(TEFusedAdamFP32StateAdopter())

__all__ = [
    "DISABLE_ENV_VAR",
    "ENTRY_POINT_GROUP",
    "StateAdopter",
    "StateAdopterRegistry",
    "StateAdoptionContext",
    "TEFusedAdamFP32StateAdopter",
    "default_registry",
    "load_inner_optimizer_state_dict",
    "register_state_adopter",
    "registered_state_adopters",
    "state_adoption_disabled",
]
