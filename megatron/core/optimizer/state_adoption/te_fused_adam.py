"""Default adopter: Transformer Engine's FusedAdam with FP32 Adam moments.

``FusedAdam.load_state_dict`` first runs PyTorch's loader, then, for every parameter,
allocates a new state tensor and copies the incoming one into it. While that loop runs the
caller still holds the incoming tensors, so two copies of the moments coexist: a transient
8 bytes per parameter. When the moments are FP32 and no TE master weights are kept, the
incoming tensors already have the exact dtype, device and shape TE would allocate, and
TE's ``step`` uses FP32 state tensors as they are. This adopter then runs only PyTorch's
loader, which installs them by reference, and skips the copy. Any other configuration is
declined and keeps TE's own loader.

The same holds for every owner that hands loaded moments to the loader: the
``DistributedOptimizer`` (its shards), Megatron-FSDP (DTensors, which TE's loader unwraps to
their local shards and wraps again with the parameter's mesh and placements; an incoming
DTensor laid out like its parameter is what that gives), and the non-distributed
``Float16OptimizerWithFloat16Params`` and ``FP32Optimizer`` (whole tensors).

Transformer Engine releases (docs/te-releases.md records what each one does): every release
from 1.13 to 2.20 allocates and copies on load and never casts or scales FP32 state.
``name_to_dtype_map`` and the boolean ``master_weights`` exist since 1.13.
``store_param_remainders`` arrived in 2.1 together with the whole param-remainder mode, so
only in 1.13, 1.14 and 2.0 does a missing attribute mean "off"; from 2.1 on TE always sets
it, and a FusedAdam without it is something this adopter does not know and declines.
"""

import sys
from typing import List, Mapping, Optional

import torch
from packaging.version import InvalidVersion, Version

from megatron.core.utils import get_te_version

from .adopter import StateAdoptionContext, StateExportContext
from .validation import (
    ExpectedState,
    first_decline_reason,
    incoming_state_decline_reason,
    owner_decline_reason,
)

__all__ = ["TEFusedAdamFP32StateAdopter", "te_fused_adam_decline_reason"]

_TE_FUSED_ADAM_MODULE = "transformer_engine.pytorch.optimizers.fused_adam"
_MOMENT_KEYS = ("exp_avg", "exp_avg_sq")

# FusedAdam methods that allocate, scale or expose state; a subclass overriding any of them
# may rely on TE's loader running.
_TE_STATE_METHODS = (
    "load_state_dict",
    "state_dict",
    "initialize_state",
    "_initialize_state",
    "set_scaled_state",
    "get_unscaled_state",
    "_apply_scale",
)

# Releases without store_param_remainders, where TE has no param-remainder mode at all
# (TE commit e5369541e, first released in 2.1, added the attribute and the mode together).
# Development builds of a release count as that release.
_FIRST_KNOWN_RELEASE = Version("1.13.0.dev0")
_FIRST_RELEASE_WITH_REMAINDERS = Version("2.1.0.dev0")

_FP32_MOMENTS: ExpectedState = {key: torch.float32 for key in _MOMENT_KEYS}


def _loaded_te_fused_adam_class() -> Optional[type]:
    """Return TE's FusedAdam if TE has already been imported, without importing it."""
    module = sys.modules.get(_TE_FUSED_ADAM_MODULE)
    fused_adam = getattr(module, "FusedAdam", None)
    return fused_adam if isinstance(fused_adam, type) else None


def te_fused_adam_decline_reason(
    optimizer: torch.optim.Optimizer, fused_adam_class: Optional[type] = None
) -> Optional[str]:
    """Accept TE's FusedAdam and subclasses that keep all of TE's state handling.

    Declines a subclass that overrides one of FusedAdam's state methods, and an instance that
    carries its own version of one (set on the instance, e.g. by a wrapper): the optimizer's
    own ``load_state_dict`` or ``state_dict`` would run that code.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer.
        fused_adam_class (type, optional): the class to recognise; defaults to TE's, if
            TE is imported.

    Returns:
        Optional[str]: None if ``optimizer`` handles state exactly as FusedAdam does.
    """
    fused_adam = fused_adam_class or _loaded_te_fused_adam_class()
    if fused_adam is None:
        return "Transformer Engine's FusedAdam is not loaded"
    optimizer_class = type(optimizer)
    if not issubclass(optimizer_class, fused_adam):
        return f"the inner optimizer is {optimizer_class.__qualname__}, not FusedAdam"
    for method in _TE_STATE_METHODS:
        if getattr(optimizer_class, method, None) is not getattr(fused_adam, method, None):
            return f"{optimizer_class.__qualname__} overrides FusedAdam.{method}"
    for method in _TE_STATE_METHODS:  # e.g. a wrapper staging state on the instance
        if method in getattr(optimizer, "__dict__", {}):
            return f"the {optimizer_class.__qualname__} instance has its own {method}"
    return None


class TEFusedAdamFP32StateAdopter:
    """Installs FP32 Adam moments into TE FusedAdam by reference.

    Args:
        fused_adam_class (type, optional): the FusedAdam class to recognise. Defaults to
            Transformer Engine's, looked up among the imported modules at check time (TE is
            never imported by this adopter). Tests on machines without TE pass a stand-in.
        param_device_type (str): device type every inner parameter and moment must be on.
        te_version (str, optional): the Transformer Engine release the class comes from.
            Defaults to MCore's ``get_te_version()``, read at check time (TE is imported by
            then: the optimizer is its FusedAdam). Tests with a stand-in pass it.
    """

    name = "te_fused_adam_fp32"

    def __init__(
        self,
        fused_adam_class: Optional[type] = None,
        param_device_type: str = "cuda",
        te_version: Optional[str] = None,
    ) -> None:
        self._fused_adam_class = fused_adam_class
        self._param_device_type = param_device_type
        self._te_version = te_version

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
                lambda: owner_decline_reason(context, precision_aware=False, megatron_fsdp=True),
                lambda: te_fused_adam_decline_reason(context.optimizer, self._fused_adam_class),
                lambda: _fp32_settings_decline_reason(context.optimizer, self._te_release()),
                lambda: incoming_state_decline_reason(
                    context.optimizer,
                    context.state_dict,
                    self._param_decline_reason,
                    lambda param: _FP32_MOMENTS,
                ),
            )
        )

    def adopt(self, context: StateAdoptionContext) -> None:
        """Run PyTorch's loader (FusedAdam's first step) and skip TE's re-allocation.

        PyTorch's loader validates the groups, installs their hyper-parameters (TE's
        per-group 'step' included) and keeps tensors whose dtype and device already match the
        parameter's, which the check made sure of. The loader measures afterwards that every
        moment is the incoming tensor.

        Args:
            context (StateAdoptionContext): a context this adopter accepted.
        """
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))

    def initialize_decline_reason(self, context: StateExportContext) -> Optional[str]:
        """Accept the optimizer and owner ``decline_reason`` accepts, with every parameter
        eligible and none holding a gradient.

        Args:
            context (StateExportContext): the optimizer and its owner's configs.

        Returns:
            Optional[str]: None to accept, otherwise why the own initialisation runs.
        """
        optimizer = context.optimizer
        return first_decline_reason(
            (
                lambda: owner_decline_reason(context, precision_aware=False, megatron_fsdp=True),
                lambda: te_fused_adam_decline_reason(optimizer, self._fused_adam_class),
                lambda: _fp32_settings_decline_reason(optimizer, self._te_release()),
                lambda: self._params_decline_reason(optimizer),
                lambda: _gradient_decline_reason(optimizer),
            )
        )

    def initialize_state(self, context: StateExportContext) -> None:
        """Run FusedAdam's own ``step()`` with no gradients.

        MCore's own initialisation gives every parameter a zero gradient and steps. TE's step
        creates the state of every parameter (``initialize_state``, zeroed moments) and advances
        each group's ``step`` before it looks at gradients, and skips the parameters without
        one; so without gradients it creates exactly that state and ``step`` and launches no
        kernel, and the zero gradients (4 bytes per parameter) are never allocated. The only
        difference is what the checkpoint overwrites: the parameters do not receive the zero
        gradient's weight-decay update. A TE release whose step created state only for
        parameters with a gradient would leave parameters without state; the loader then
        restores the optimizer and the own initialisation runs.

        Args:
            context (StateExportContext): a context this adopter accepted.
        """
        context.optimizer.step()

    def _params_decline_reason(self, optimizer: torch.optim.Optimizer) -> Optional[str]:
        """The first parameter :meth:`_param_decline_reason` declines, worded as the
        incoming-state checks word it; None if it accepts them all."""
        for index, param in enumerate(_params(optimizer)):
            reason = self._param_decline_reason(param)
            if reason is not None:
                return f"parameter {index}: {reason}"
        return None

    def _te_release(self) -> Optional[Version]:
        """The Transformer Engine release, or None if its version string is not a version."""
        try:
            return Version(self._te_version) if self._te_version is not None else get_te_version()
        except InvalidVersion:
            return None

    def _param_decline_reason(self, param: torch.Tensor) -> Optional[str]:
        """Accept plain FP32 parameters on the expected device type, or DTensor parameters
        whose local shard is one (Megatron-FSDP's)."""
        local = _local_shard(param)
        if type(local) not in (torch.Tensor, torch.nn.Parameter):
            return f"is a {type(param).__name__}, not a plain tensor or a DTensor of one"
        if param.dtype != torch.float32:
            return f"is {param.dtype}, not torch.float32"
        if param.device.type != self._param_device_type:
            return f"is on {param.device}, not on {self._param_device_type}"
        return None


def _local_shard(param: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's local shard (Megatron-FSDP), or the parameter itself."""
    to_local = getattr(param, "to_local", None)
    local: torch.Tensor = to_local() if callable(to_local) else param
    return local


def _params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every parameter of ``optimizer``, group by group."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def _gradient_decline_reason(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Accept only parameters without gradients (a step without gradients changes no parameter)."""
    for index, param in enumerate(_params(optimizer)):
        for attribute in ("grad", "decoupled_grad"):
            if getattr(param, attribute, None) is not None:
                return f"parameter {index} has a {attribute}, which a step would apply"
    return None


def _remainders_decline_reason(
    optimizer: torch.optim.Optimizer, te_version: Optional[Version]
) -> Optional[str]:
    """Accept ``store_param_remainders`` off, or absent in a release that has no such mode."""
    if hasattr(optimizer, "store_param_remainders"):
        return (
            "FusedAdam.store_param_remainders is set" if optimizer.store_param_remainders else None
        )
    if te_version is None:
        return (
            "FusedAdam has no 'store_param_remainders' attribute and the Transformer Engine "
            "release is unknown"
        )
    if te_version < _FIRST_KNOWN_RELEASE:
        return (
            f"Transformer Engine {te_version} predates 1.13, the first release whose FusedAdam "
            "this adopter knows"
        )
    if te_version >= _FIRST_RELEASE_WITH_REMAINDERS:
        return (
            "FusedAdam has no 'store_param_remainders' attribute, which Transformer Engine "
            f"{te_version} always sets"
        )
    return None


def _fp32_settings_decline_reason(
    optimizer: torch.optim.Optimizer, te_version: Optional[Version]
) -> Optional[str]:
    """Accept only FP32 moments without TE master weights or param remainders."""
    if not hasattr(optimizer, "master_weights"):
        return "FusedAdam has no 'master_weights' attribute"
    if optimizer.master_weights:
        return "FusedAdam.master_weights is set"
    reason = _remainders_decline_reason(optimizer, te_version)
    if reason is not None:
        return reason
    dtypes = getattr(optimizer, "name_to_dtype_map", None)
    if not isinstance(dtypes, Mapping):
        return "FusedAdam has no 'name_to_dtype_map'"
    for key in _MOMENT_KEYS:
        if dtypes.get(key) is not torch.float32:
            return f"FusedAdam keeps {key} in {dtypes.get(key)}, not torch.float32"
    return None
