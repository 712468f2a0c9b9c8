"""Default adopter: Transformer Engine's FusedAdam with FP32 Adam moments.

``FusedAdam.load_state_dict`` first runs PyTorch's loader, then, for every parameter,
allocates a new state tensor and copies the incoming one into it. While that loop runs the
caller still holds the incoming tensors, so two copies of the moments coexist: a transient
8 bytes per parameter. When the moments are FP32 and no TE master weights are kept, the
incoming tensors already have the exact dtype, device and shape TE would allocate, and
TE's ``step`` uses FP32 state tensors as they are. This adopter then runs only PyTorch's
loader, which installs them by reference, and skips the copy. Any other configuration is
declined and keeps TE's own loader.
"""

import sys
from typing import Mapping, Optional

import torch

from .adopter import StateAdoptionContext
from .validation import (
    ExpectedState,
    first_decline_reason,
    incoming_state_decline_reason,
    load_pre_hooks_decline_reason,
    owner_decline_reason,
    param_state_pairs,
)

TE_FUSED_ADAM_MODULE = "transformer_engine.pytorch.optimizers.fused_adam"
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")

# FusedAdam methods that allocate, scale or expose state; a subclass overriding any of them
# may rely on TE's loader running.
TE_STATE_METHODS = (
    "load_state_dict",
    "state_dict",
    "initialize_state",
    "_initialize_state",
    "set_scaled_state",
    "get_unscaled_state",
    "_apply_scale",
)

_FP32_MOMENTS: ExpectedState = {key: torch.float32 for key in MOMENT_KEYS}


def loaded_te_fused_adam_class() -> Optional[type]:
    """Return TE's FusedAdam if TE has already been imported, without importing it."""
    module = sys.modules.get(TE_FUSED_ADAM_MODULE)
    fused_adam = getattr(module, "FusedAdam", None)
    return fused_adam if isinstance(fused_adam, type) else None


def te_fused_adam_decline_reason(
    optimizer: torch.optim.Optimizer, fused_adam_class: Optional[type] = None
) -> Optional[str]:
    """Accept TE's FusedAdam and subclasses that keep all of TE's state handling.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer.
        fused_adam_class (type, optional): the class to recognise; defaults to TE's, if
            TE is imported.

    Returns:
        Optional[str]: None if ``optimizer`` handles state exactly as FusedAdam does.
    """
    fused_adam = fused_adam_class or loaded_te_fused_adam_class()
    if fused_adam is None:
        return "Transformer Engine's FusedAdam is not loaded"
    optimizer_class = type(optimizer)
    if not issubclass(optimizer_class, fused_adam):
        return f"the inner optimizer is {optimizer_class.__qualname__}, not FusedAdam"
    for method in TE_STATE_METHODS:
        if getattr(optimizer_class, method, None) is not getattr(fused_adam, method, None):
            return f"{optimizer_class.__qualname__} overrides FusedAdam.{method}"
    return None


class TEFusedAdamFP32StateAdopter:
    """Installs FP32 Adam moments into TE FusedAdam by reference.

    Args:
        fused_adam_class (type, optional): the FusedAdam class to recognise. Defaults to
            Transformer Engine's, looked up among the imported modules at check time (TE is
            never imported by this adopter). Tests on machines without TE pass a stand-in.
        param_device_type (str): device type every inner parameter and moment must be on.
    """

    name = "te_fused_adam_fp32"

    def __init__(
        self, fused_adam_class: Optional[type] = None, param_device_type: str = "cuda"
    ) -> None:
        self._fused_adam_class = fused_adam_class
        self._param_device_type = param_device_type

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        """Return None if every eligibility rule holds, else the first rule that fails.

        Args:
            context (StateAdoptionContext): the optimizer and the incoming state.

        Returns:
            Optional[str]: None to accept, otherwise why the state is left to TE's loader.
        """
        return first_decline_reason(
            (
                lambda: owner_decline_reason(context, precision_aware=False),
                lambda: te_fused_adam_decline_reason(context.optimizer, self._fused_adam_class),
                lambda: load_pre_hooks_decline_reason(context.optimizer),
                lambda: _fp32_settings_decline_reason(context.optimizer),
                lambda: incoming_state_decline_reason(
                    context.optimizer,
                    context.state_dict,
                    self._param_decline_reason,
                    lambda param: _FP32_MOMENTS,
                ),
            )
        )

    def adopt(self, context: StateAdoptionContext) -> int:
        """Run PyTorch's loader (FusedAdam's first step) and skip TE's re-allocation.

        Args:
            context (StateAdoptionContext): a context this adopter accepted.

        Returns:
            int: bytes of moments installed by reference, which TE would have re-allocated.
        """
        optimizer = context.optimizer
        pairs = list(param_state_pairs(optimizer, context.state_dict))
        # PyTorch's loader validates the groups, installs their hyper-parameters (TE's
        # per-group 'step' included), runs post-hooks (pre-hooks were declined) and keeps
        # tensors whose dtype and device already match the parameter's, which were checked.
        torch.optim.Optimizer.load_state_dict(optimizer, dict(context.state_dict))
        adopted_bytes = 0
        for index, param, incoming in pairs:
            installed = optimizer.state[param]
            for key in MOMENT_KEYS:
                if installed.get(key) is not incoming[key]:
                    raise RuntimeError(
                        f"PyTorch's loader did not keep {key} of parameter {index} by reference"
                    )
                adopted_bytes += incoming[key].nbytes
        return adopted_bytes

    def _param_decline_reason(self, param: torch.Tensor) -> Optional[str]:
        """Accept plain FP32 parameters on the expected device type."""
        if type(param) not in (torch.Tensor, torch.nn.Parameter):
            return f"is a {type(param).__name__}, not a plain tensor"
        if param.dtype != torch.float32:
            return f"is {param.dtype}, not torch.float32"
        if param.device.type != self._param_device_type:
            return f"is on {param.device}, not on {self._param_device_type}"
        return None


def _fp32_settings_decline_reason(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Accept only FP32 moments without TE master weights or param remainders."""
    for flag in ("master_weights", "store_param_remainders"):
        if not hasattr(optimizer, flag):
            return f"FusedAdam has no '{flag}' attribute"
        if getattr(optimizer, flag):
            return f"FusedAdam.{flag} is set"
    dtypes = getattr(optimizer, "name_to_dtype_map", None)
    if not isinstance(dtypes, Mapping):
        return "FusedAdam has no 'name_to_dtype_map'"
    for key in MOMENT_KEYS:
        if dtypes.get(key) is not torch.float32:
            return f"FusedAdam keeps {key} in {dtypes.get(key)}, not torch.float32"
    return None
