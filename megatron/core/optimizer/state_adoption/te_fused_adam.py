"""The built-in adopter: Transformer Engine's FusedAdam with FP32 moments.

``FusedAdam.load_state_dict`` runs PyTorch's loader, then allocates a new tensor for every
state and copies the incoming one into it while the caller still holds the incoming tensors:
8 bytes per parameter of transient memory for FP32 Adam moments. With FP32 moments and no TE
master weights, the incoming tensors have exactly the dtype, device and shape TE would allocate,
and TE's ``step`` uses FP32 state as it is; this adopter runs only PyTorch's loader, which
installs them by reference. For Megatron-FSDP it also lets TE's own ``step()`` create the state
a checkpoint is read into without the dummy step's zero gradients (4 bytes per parameter).

Transformer Engine releases (docs/te-releases.md): 1.13 to 2.20 allocate and copy on load and
never scale FP32 state; ``store_param_remainders`` exists from 2.1 on (with the remainder mode),
so only before 2.1 does its absence mean "off".
"""

import sys
from typing import Any, List, Mapping, Optional, Tuple

import torch
from packaging.version import InvalidVersion, Version

from megatron.core.utils import get_te_version

from .adopter import AdoptionContext, StateAdopter
from .checks import first_problem, incoming_state_problem, local, owner_problem, params_of

__all__: List[str] = []

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
_FUSED_ADAM_MODULE = "transformer_engine.pytorch.optimizers.fused_adam"
# FusedAdam methods that allocate, scale or expose state: overriding one may rely on TE's loader.
_STATE_METHODS = (
    "load_state_dict",
    "state_dict",
    "initialize_state",
    "_initialize_state",
    "set_scaled_state",
    "get_unscaled_state",
    "_apply_scale",
)
_FIRST_KNOWN, _FIRST_WITH_REMAINDERS = Version("1.13.0.dev0"), Version("2.1.0.dev0")


def fused_adam_problem(
    optimizer: Any,
    fused_adam_class: Optional[type] = None,
    methods: Tuple[str, ...] = _STATE_METHODS,
) -> Optional[str]:
    """Accept TE's FusedAdam (found among the imported modules) and subclasses that keep its
    ``methods``; decline one that overrides one of them, on its class or instance."""
    fused_adam = fused_adam_class or getattr(sys.modules.get(_FUSED_ADAM_MODULE), "FusedAdam", None)
    if not isinstance(fused_adam, type):
        return "Transformer Engine's FusedAdam is not loaded"
    cls = type(optimizer)
    if not issubclass(cls, fused_adam):
        return f"the inner optimizer is {cls.__qualname__}, not FusedAdam"
    for method in methods:
        if getattr(cls, method, None) is not getattr(fused_adam, method, None):
            return f"{cls.__qualname__} overrides FusedAdam.{method}"
        if method in getattr(optimizer, "__dict__", {}):
            return f"the {cls.__qualname__} instance has its own {method}"
    return None


def _remainders_problem(optimizer: Any, te_version: Optional[Version]) -> Optional[str]:
    """Accept ``store_param_remainders`` off, or absent in a release without that mode."""
    if hasattr(optimizer, "store_param_remainders"):
        return (
            "FusedAdam.store_param_remainders is set" if optimizer.store_param_remainders else None
        )
    if te_version is None:
        return "FusedAdam has no 'store_param_remainders' and the TE release is unknown"
    if te_version < _FIRST_KNOWN:
        return (
            f"Transformer Engine {te_version} predates 1.13, the first release this adopter knows"
        )
    if te_version >= _FIRST_WITH_REMAINDERS:
        return (
            f"FusedAdam has no 'store_param_remainders', which Transformer Engine {te_version} sets"
        )
    return None


def _fp32_settings_problem(optimizer: Any, te_version: Optional[Version]) -> Optional[str]:
    """Accept only FP32 moments without TE master weights or param remainders."""
    if not hasattr(optimizer, "master_weights"):
        return "FusedAdam has no 'master_weights'"
    if optimizer.master_weights:
        return "FusedAdam.master_weights is set"
    reason = _remainders_problem(optimizer, te_version)
    if reason is not None:
        return reason
    dtypes = getattr(optimizer, "name_to_dtype_map", None)
    if not isinstance(dtypes, Mapping):
        return "FusedAdam has no 'name_to_dtype_map'"
    for key in MOMENT_KEYS:
        if dtypes.get(key) is not torch.float32:
            return f"FusedAdam keeps {key} in {dtypes.get(key)}, not torch.float32"
    return None


class TEFusedAdamFP32StateAdopter(StateAdopter):
    """Installs FP32 Adam moments into TE FusedAdam by reference.

    Args:
        fused_adam_class (type, optional): the class to recognise; defaults to TE's, looked up
            among the imported modules (TE is never imported here). CPU tests pass a stand-in.
        device_type (str): the device type of every parameter and moment.
        te_version (str, optional): the TE release; defaults to ``get_te_version()``.
    """

    name = "te_fused_adam_fp32"

    def __init__(
        self,
        fused_adam_class: Optional[type] = None,
        device_type: str = "cuda",
        te_version: Optional[str] = None,
    ) -> None:
        self._fused_adam_class = fused_adam_class
        self._device_type = device_type
        self._te_version = te_version

    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """None if every eligibility rule holds, else the first that fails."""
        return first_problem(
            lambda: self._optimizer_problem(context),
            lambda: incoming_state_problem(
                context,
                self._param_problem,
                lambda param: dict.fromkeys(MOMENT_KEYS, torch.float32),
            ),
        )

    def adopt(self, context: AdoptionContext) -> None:
        """Run PyTorch's loader, FusedAdam's first half: it installs the groups (TE's per-group
        ``step`` included) and keeps tensors of the parameter's dtype and device as they are."""
        assert context.state_dict is not None
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))

    def initialize_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Accept what ``decline_reason`` accepts of the optimizer and its parameters: TE's step
        creates every parameter's state (zeroed moments) and advances each group's ``step``
        before it skips parameters without gradients, and launches no kernel then."""

        def params_problem() -> Optional[str]:
            for index, param in enumerate(params_of(context.optimizer)):
                reason = self._param_problem(param)
                if reason is not None:
                    return f"parameter {index}: {reason}"
            return None

        return first_problem(
            lambda: self._optimizer_problem(context),
            lambda: fused_adam_problem(context.optimizer, self._fused_adam_class, ("step",)),
            params_problem,
        )

    def _optimizer_problem(self, context: AdoptionContext) -> Optional[str]:
        """The owner's mode, TE's class and the instance's FP32 settings."""
        try:
            te_version: Optional[Version] = (
                Version(self._te_version) if self._te_version is not None else get_te_version()
            )
        except InvalidVersion:
            te_version = None
        return first_problem(
            lambda: owner_problem(context, precision_aware=False),
            lambda: fused_adam_problem(context.optimizer, self._fused_adam_class),
            lambda: _fp32_settings_problem(context.optimizer, te_version),
        )

    def _param_problem(self, param: torch.Tensor) -> Optional[str]:
        """Accept plain FP32 parameters on the device type, or DTensors of them (Megatron-FSDP)."""
        if type(local(param)) not in (torch.Tensor, torch.nn.Parameter):
            return f"is a {type(param).__name__}, not a plain tensor or a DTensor of one"
        if param.dtype != torch.float32:
            return f"is {param.dtype}, not torch.float32"
        if param.device.type != self._device_type:
            return f"is on {param.device}, not on {self._device_type}"
        return None
