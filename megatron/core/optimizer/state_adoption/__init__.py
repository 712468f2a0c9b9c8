# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""Optimizer-state adoption: Megatron-Core's optimizers load checkpoints through state adopters.

Where Megatron-Core hands loaded state to an inner optimizer (the call-site functions below),
the first registered :class:`StateAdopter` that accepts acts in place of the inner optimizer's
own code. Megatron-Core registers two:

- ``te_fused_adam_fp32`` installs Transformer Engine FusedAdam's FP32 moments by reference, not
  as a second copy (8 bytes per parameter at the load peak);
- ``te_fused_adam_bf16`` (:class:`TEFusedAdamPrecisionAwareStateAdopter`) does the same for the
  precision-aware optimizer's BF16 moments where
  ``OptimizerConfig.precision_aware_optimizer_state_adoption`` opts in.

``OptimizerConfig.optimizer_state_adoption = False`` switches adoption off: every call site then
runs upstream's code and nothing else.
"""

from .adopter import AdoptionContext, StateAdopter
from .call_sites import (
    export_inner_optimizer_state_dict,
    initialize_inner_optimizer_state,
    load_inner_optimizer_state_dict,
    reading_optimizer_state,
    store_read_optimizer_state,
    unscaled_state_or_read_target,
)
from .registry import AdoptionOutcome, StateAdopterRegistry, default_registry
from .te_fused_adam import TEFusedAdamFP32StateAdopter, TEFusedAdamPrecisionAwareStateAdopter

__all__ = [
    "AdoptionContext",
    "AdoptionOutcome",
    "StateAdopter",
    "StateAdopterRegistry",
    "TEFusedAdamPrecisionAwareStateAdopter",
    "default_registry",
    "export_inner_optimizer_state_dict",
    "initialize_inner_optimizer_state",
    "load_inner_optimizer_state_dict",
    "reading_optimizer_state",
    "store_read_optimizer_state",
    "unscaled_state_or_read_target",
]

default_registry().register(TEFusedAdamFP32StateAdopter())
default_registry().register(
    TEFusedAdamPrecisionAwareStateAdopter(name="te_fused_adam_bf16", requires_config_opt_in=True)
)
