"""Optimizer-state adoption for ``DistributedOptimizer`` checkpoint loading.

While a ``DistributedOptimizer`` loads its inner optimizer's state (both when it builds the
scaffold for a sharded checkpoint and after the checkpoint was read), it reads the inner
state dict through :func:`export_inner_optimizer_state_dict` and hands the assembled
``{"state", "param_groups"}`` dict to :func:`load_inner_optimizer_state_dict`. The first
registered :class:`StateAdopter` that accepts installs the state (and, if it is also a
:class:`StateExporter`, may supply the state dict); otherwise the inner optimizer's own
``load_state_dict``/``state_dict`` runs unchanged. Each call's
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

from .adopter import StateAdopter, StateAdoptionContext, StateExportContext, StateExporter
from .loader import export_inner_optimizer_state_dict, load_inner_optimizer_state_dict
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
    "export_inner_optimizer_state_dict",
    "load_inner_optimizer_state_dict",
    "register_outcome_hook",
    "register_state_adopter",
    "registered_state_adopters",
]
