"""Adopter for TE FusedAdam with BF16 moments (Megatron-Core's precision-aware optimizer).

Megatron-Core loads the inner optimizer twice while resuming from a ``torch_dist`` checkpoint,
and TE's ``FusedAdam.load_state_dict`` rebuilds the whole state both times:

* **Scaffold pass.** MCore offers freshly allocated BF16 moments and master weights (FP32, or
  int16 remainders of BF16 parameters). TE upcasts each to an FP32 copy, allocates new
  tensors and copies the values back — exactly the incoming values. This adopter installs
  the incoming tensors by reference instead, and gives each non-FP32 state the scale of one
  TE's loader creates with it (see ``held_state.create_scales_as_te_loads``): no tensor of
  state is allocated, not even one parameter's.
* **Export, before the payload pass.** MCore reads ``FusedAdam.state_dict()`` only for the
  param groups and to hand the state back to ``load_state_dict``; TE's ``state_dict()`` makes
  an FP32 copy of every BF16 moment (8 bytes per parameter, alive at the load peak). As a
  state exporter this adopter supplies PyTorch's state dict instead: the held tensors as they
  are (see ``export``).
* **Read targets.** MCore then builds the sharded state dict the checkpoint is read into, and
  upstream reads every BF16 moment into an FP32 copy (``get_unscaled_state``: 8 bytes per
  parameter, alive through the whole read). As a read-target provider this adopter supplies
  the held BF16 moments themselves: ``torch_dist`` casts the checkpoint's FP32 values into them
  in place, which is bit for bit TE's ``set_scaled_state`` conversion (``copy_(fp32.bfloat16())``),
  so nothing is left to store afterwards. Master weights are already read in place upstream.
* **Payload pass.** MCore offers the exported state: the held tensors themselves (or, if the
  export was not used, FP32 copies of the BF16 moments). TE's loader would cast all of it to a
  whole new state (one more state shard at the load peak). This adopter keeps the held
  tensors, or stores TE's conversion of each FP32 moment into the BF16 tensor already held
  (see ``held_state``): the same bits, no new state.

Anything it cannot prove equal to TE's result is declined: FP16/FP8 moments (TE rescales
them), non-FP32 master weights, DTensor or quantized parameters, a held state TE would lay out
differently, incoming tensors overlapping held ones, and every non-precision-aware owner (the
default FP32 adopter handles that). An optimizer with ``load_state_dict``/``state_dict`` hooks
or with such a method set on the instance never reaches it: MCore's loader runs the
optimizer's own method then, so every hook runs exactly as often as upstream.
"""

from typing import Any, Dict, Mapping, Optional, Union

import torch

from megatron.core.optimizer.state_adoption import StateAdoptionContext, StateExportContext
from megatron.core.optimizer.state_adoption.te_fused_adam import te_fused_adam_decline_reason
from megatron.core.optimizer.state_adoption.validation import (
    ExpectedState,
    first_decline_reason,
    incoming_state_decline_reason,
    owner_decline_reason,
    param_state_pairs,
)

from .export import held_state_export_decline_reason, state_dict_of_held_tensors
from .held_state import create_scales_as_te_loads, held_state_decline_reason, load_into_held_state

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


class TEFusedAdamPrecisionAwareStateAdopter:
    """Installs BF16 moments and TE master weights by reference, or loads into the held state;
    exports the held state as it is.

    Args:
        fused_adam_class (type, optional): the FusedAdam class to recognise; defaults to TE's
            (looked up among imported modules). Tests without a GPU pass a stand-in.
        param_device_type (str): device type every parameter and state tensor must be on.
    """

    name = "te_fused_adam_precision_aware"

    def __init__(
        self, fused_adam_class: Optional[type] = None, param_device_type: str = "cuda"
    ) -> None:
        self._fused_adam_class = fused_adam_class
        self._param_device_type = param_device_type

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        """Return None if the state can be adopted exactly, else the first failing rule.

        Args:
            context (StateAdoptionContext): the optimizer and the incoming state.

        Returns:
            Optional[str]: None to accept, otherwise why TE's loader should run.
        """
        # Optimizers with load_state_dict hooks, or with a load_state_dict set on the instance,
        # never reach an adopter: MCore's loader runs their own load_state_dict.
        reason = self._mode_decline_reason(context)
        if reason is not None:
            return reason
        held_reason = self._held_decline_reason(context)
        if held_reason is None:
            return None
        scaffold_reason = self._scaffold_decline_reason(context)
        if scaffold_reason is None:
            return None
        return f"cannot load into the held state ({held_reason}); not a scaffold to adopt ({scaffold_reason})"

    def export_decline_reason(self, context: StateExportContext) -> Optional[str]:
        """Return None if the held state can be exported as it is, else the first failing rule.

        Args:
            context (StateExportContext): the optimizer and its owner's configs.

        Returns:
            Optional[str]: None to accept, otherwise why TE's ``state_dict()`` should run.
        """
        optimizer = context.optimizer
        return first_decline_reason(
            (
                lambda: self._mode_decline_reason(context),
                lambda: held_state_export_decline_reason(
                    optimizer,
                    self._param_decline_reason,
                    lambda param: _expected_state(optimizer, param),
                ),
            )
        )

    def export_state_dict(self, context: StateExportContext) -> Dict[str, Any]:
        """Return PyTorch's state dict of the FusedAdam: the held tensors, no FP32 copies.

        MCore checks it against the held state and measures what it holds by reference.

        Args:
            context (StateExportContext): a context this adopter accepted.

        Returns:
            Dict[str, Any]: the ``{"state", "param_groups"}`` dict.
        """
        return state_dict_of_held_tensors(context.optimizer)

    def read_target_decline_reason(self, context: StateExportContext) -> Optional[str]:
        """Return None if the held BF16 moments can be the read targets, else the first failing
        rule.

        Args:
            context (StateExportContext): the optimizer and its owner's configs.

        Returns:
            Optional[str]: None to accept, otherwise why upstream's FP32 copies should be read
            into.
        """
        optimizer = context.optimizer
        return first_decline_reason(
            (
                lambda: self._mode_decline_reason(context),
                lambda: _stepped_decline_reason(optimizer),
                lambda: held_state_export_decline_reason(
                    optimizer,
                    self._param_decline_reason,
                    lambda param: _expected_state(optimizer, param),
                ),
            )
        )

    def read_target(
        self, context: StateExportContext, param: torch.Tensor, name: str
    ) -> torch.Tensor:
        """Return the held BF16 moment itself, or TE's own tensor for the master weights.

        Args:
            context (StateExportContext): a context this adopter accepted.
            param (torch.Tensor): the FusedAdam's parameter.
            name (str): the state's name.

        Returns:
            torch.Tensor: the tensor the checkpoint's values are read into.
        """
        optimizer: Any = context.optimizer
        if name in MOMENT_KEYS:
            moment: torch.Tensor = optimizer.state[param][name]
            return moment
        # FP32 master weights and int16 remainders: TE returns the held tensor itself.
        own: torch.Tensor = optimizer.get_unscaled_state(param, name)
        return own

    def adopt(self, context: StateAdoptionContext) -> None:
        """Install the scaffold by reference, or store the payload into the held state.

        MCore measures afterwards which state tensors existed before the call.

        Args:
            context (StateAdoptionContext): a context this adopter accepted.
        """
        optimizer: Any = context.optimizer  # TE FusedAdam (checked); its attributes are untyped
        pairs = list(param_state_pairs(optimizer, context.state_dict))
        adopts_scaffold = self._held_decline_reason(context) is not None
        held = {} if adopts_scaffold else {param: optimizer.state[param] for _, param, _ in pairs}
        # PyTorch's loader would cast master weights to the BF16 parameter dtype, so it only
        # installs the param groups here (hyper-parameters and TE's per-group 'step').
        groups = list(context.state_dict["param_groups"])
        torch.optim.Optimizer.load_state_dict(optimizer, {"state": {}, "param_groups": groups})
        for _, param, incoming in pairs:
            if adopts_scaffold:
                optimizer.state[param] = dict(incoming)
                create_scales_as_te_loads(optimizer, param, incoming)
            else:
                optimizer.state[param] = held[param]
                load_into_held_state(held[param], incoming)

    def _mode_decline_reason(
        self, context: Union[StateAdoptionContext, StateExportContext]
    ) -> Optional[str]:
        """None for a precision-aware owner of an unmodified TE FusedAdam with BF16 moments."""
        return first_decline_reason(
            (
                lambda: owner_decline_reason(context, precision_aware=True),
                lambda: te_fused_adam_decline_reason(context.optimizer, self._fused_adam_class),
                lambda: _settings_decline_reason(context.optimizer),
            )
        )

    def _held_decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        """None if the incoming values can be loaded into the state the optimizer holds."""
        optimizer = context.optimizer
        return held_state_decline_reason(
            optimizer,
            context.state_dict,
            self._param_decline_reason,
            lambda param: _expected_state(optimizer, param),
        )

    def _scaffold_decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        """None if the incoming tensors have the held dtypes and can be installed by reference."""
        optimizer = context.optimizer
        return incoming_state_decline_reason(
            optimizer,
            context.state_dict,
            self._param_decline_reason,
            lambda param: _expected_state(optimizer, param),
        )

    def _param_decline_reason(self, param: torch.Tensor) -> Optional[str]:
        """Accept plain floating-point parameters on the expected device type."""
        if type(param) not in (torch.Tensor, torch.nn.Parameter):
            return f"is a {type(param).__name__}, not a plain tensor"
        if not param.is_floating_point():
            return f"is {param.dtype}, not a floating-point tensor"
        if param.device.type != self._param_device_type:
            return f"is on {param.device}, not on {self._param_device_type}"
        return None


def _expected_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> ExpectedState:
    """The keys and dtypes TE's loader would leave for ``param``."""
    expected = {key: torch.bfloat16 for key in MOMENT_KEYS}
    if getattr(optimizer, "master_weights", False):
        remainders = bool(getattr(optimizer, "store_param_remainders", False))
        keeps_remainders = remainders and param.dtype == torch.bfloat16
        expected["master_param"] = torch.int16 if keeps_remainders else torch.float32
    return expected


def _stepped_decline_reason(optimizer: Any) -> Optional[str]:
    """Decline an optimizer that has stepped: its state may be a user's trained state, which a
    read that fails midway would leave half overwritten (upstream's copies leave it intact)."""
    for index, group in enumerate(optimizer.param_groups):
        if group.get("step"):
            return (
                f"param group {index} has step {group['step']}: the held state may be trained "
                "state, which a failed read would leave half overwritten"
            )
    return None


def _settings_decline_reason(optimizer: Any) -> Optional[str]:
    """Accept BF16 moments and, with master weights, FP32 masters; require TE's public API."""
    for attribute in ("master_weights", "store_param_remainders", "name_to_dtype_map"):
        if not hasattr(optimizer, attribute):
            return f"FusedAdam has no '{attribute}' attribute"
    if not callable(getattr(optimizer, "initialize_state", None)):
        return "FusedAdam has no public initialize_state()"
    dtypes = optimizer.name_to_dtype_map
    if not isinstance(dtypes, Mapping):
        return "FusedAdam.name_to_dtype_map is not a mapping"
    for key in MOMENT_KEYS:
        if dtypes.get(key) is not torch.bfloat16:
            return f"FusedAdam keeps {key} in {dtypes.get(key)}; only BF16 moments are adopted"
    if optimizer.master_weights and dtypes.get("master_param") is not torch.float32:
        return f"FusedAdam keeps master weights in {dtypes.get('master_param')}, not torch.float32"
    return None
