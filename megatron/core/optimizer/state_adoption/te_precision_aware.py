"""Opt-in adopter for TE FusedAdam with BF16 moments (the precision-aware optimizer).

Not registered by default: register it, or install a plugin whose entry point names it. Over
the held state (BF16 moments, master weights in FP32 or as int16 remainders: 6 bytes per
parameter), a ``dp_reshardable`` resume allocates FP32 copies of the moments to read into, TE's
FP32 copies in ``state_dict()`` and a whole new state in TE's loader. This adopter avoids each:

* scaffold load (pass 1): installs MCore's new state by reference, with TE's scales of one;
* export: the held tensors themselves instead of FP32 copies;
* read: the held BF16 moments are the read targets; ``torch_dist`` casts the checkpoint's FP32
  values into them in place, bit for bit TE's ``copy_(fp32.bfloat16())``;
* payload load (pass 2): keeps the held tensors, storing TE's conversion of FP32 values into
  them in chunks.

It declines what it cannot prove equal to TE's result: FP16/FP8 moments (scaled), non-FP32
master weights, non-plain or non-floating parameters, a held state laid out otherwise, and read
targets once a group has stepped (a read failing midway would overwrite trained state).
"""

from dataclasses import replace
from functools import partial
from typing import Any, Dict, List, Optional

import torch

from .adopter import AdoptionContext, StateAdopter
from .checks import (
    ExpectedState,
    first_problem,
    held_extents,
    held_state_dict,
    incoming_state_problem,
    owner_problem,
    paired_state,
    param_groups_problem,
    params_of,
    same_memory,
    tensor_problem,
)
from .te_fused_adam import MOMENT_KEYS, fused_adam_problem

__all__: List[str] = []

#: Elements converted at a time: bounds the transient of a BF16 store to 8 MiB.
STORE_CHUNK_ELEMENTS = 1 << 22


class TEFusedAdamPrecisionAwareStateAdopter(StateAdopter):
    """Loads, exports and reads TE FusedAdam's BF16-moment state without copies.

    Args:
        fused_adam_class (type, optional): the class to recognise; defaults to TE's.
        device_type (str): the device type of every parameter and state tensor.
    """

    name = "te_fused_adam_precision_aware"

    def __init__(self, fused_adam_class: Optional[type] = None, device_type: str = "cuda") -> None:
        self._fused_adam_class = fused_adam_class
        self._device_type = device_type

    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Accept a payload to store into the held state, or a scaffold to install."""
        reason = self._mode_problem(context)
        payload = reason or self._payload_problem(context)
        if payload is None:
            return None
        expected = partial(_expected, context.optimizer)
        scaffold = reason or incoming_state_problem(context, self._param_problem, expected)
        return (
            None
            if scaffold is None
            else reason or f"no payload ({payload}), no scaffold ({scaffold})"
        )

    def adopt(self, context: AdoptionContext) -> None:
        """Install the scaffold by reference, or store the payload into the held tensors."""
        optimizer: Any = context.optimizer
        assert context.state_dict is not None
        pairs, payload = (
            list(paired_state(optimizer, context.state_dict)),
            self._payload_problem(context) is None,
        )
        held = {id(param): optimizer.state.get(param) for _, param, _ in pairs}
        # PyTorch's loader would cast master weights to the BF16 parameters' dtype: groups only.
        groups = list(context.state_dict["param_groups"])
        torch.optim.Optimizer.load_state_dict(optimizer, {"state": {}, "param_groups": groups})
        for _, param, incoming in pairs:
            if payload:
                optimizer.state[param] = held[id(param)]
                for key, value in incoming.items():
                    _store_as_te_loads(value, held[id(param)][key])
                continue
            optimizer.state[param] = dict(incoming)
            for key in incoming:  # TE's _initialize_state gives every non-FP32 state a scale
                if optimizer.name_to_dtype_map[key] != torch.float32:
                    scale = torch.ones([1], dtype=torch.float32, device=param.device)
                    optimizer._scales.setdefault(param, {})[key] = scale

    def export_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Accept a held state laid out as TE's loader leaves it, with scales of one."""
        return first_problem(
            lambda: self._mode_problem(context), lambda: self._held_problem(context)
        )

    def export_state_dict(self, context: AdoptionContext) -> Dict[str, Any]:
        """PyTorch's state dict of the FusedAdam: its groups and the held tensors themselves."""
        return held_state_dict(context.optimizer)

    def read_target_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Accept what the export accepts, for an optimizer that has not stepped."""
        if any(group.get("step") for group in context.optimizer.param_groups):
            return "a param group has stepped: its held state may be trained state"
        return self.export_decline_reason(context)

    def read_target(self, context: AdoptionContext, param: torch.Tensor, name: str) -> torch.Tensor:
        """The held BF16 moment; for master weights TE's own target (the held tensor)."""
        optimizer: Any = context.optimizer
        if name in MOMENT_KEYS:
            moment: torch.Tensor = optimizer.state[param][name]
            return moment
        target: torch.Tensor = optimizer.get_unscaled_state(param, name)
        return target

    def _mode_problem(self, context: AdoptionContext) -> Optional[str]:
        """A precision-aware owner of an unmodified FusedAdam with BF16 moments."""
        optimizer: Any = context.optimizer

        def settings_problem() -> Optional[str]:
            for attribute in (
                "master_weights",
                "store_param_remainders",
                "name_to_dtype_map",
                "_scales",
            ):
                if not hasattr(optimizer, attribute):
                    return f"FusedAdam has no '{attribute}'"
            dtypes = optimizer.name_to_dtype_map
            wrong = [k for k in MOMENT_KEYS if dtypes.get(k) is not torch.bfloat16]
            if optimizer.master_weights and dtypes.get("master_param") is not torch.float32:
                wrong.append("master_param")
            return f"FusedAdam keeps {wrong[0]} in {dtypes.get(wrong[0])}" if wrong else None

        return first_problem(
            lambda: owner_problem(context, precision_aware=True),
            lambda: fused_adam_problem(optimizer, self._fused_adam_class),
            settings_problem,
            lambda: next(filter(None, map(self._param_problem, params_of(optimizer))), None),
        )

    def _param_problem(self, param: torch.Tensor) -> Optional[str]:
        """Accept plain floating-point parameters on the device type."""
        if type(param) not in (torch.Tensor, torch.nn.Parameter):
            return f"a parameter is a {type(param).__name__}, not a plain tensor"
        if not param.is_floating_point() or param.device.type != self._device_type:
            return f"a parameter is {param.dtype} on {param.device}"
        return None

    def _held_problem(self, context: AdoptionContext) -> Optional[str]:
        """Every parameter holds the state TE's loader lays out, each BF16 scale one."""
        optimizer: Any = context.optimizer
        if not optimizer.state:
            return "the optimizer holds no state yet"
        held = replace(context, state_dict=held_state_dict(optimizer), owns_state_dict=False)
        reason = incoming_state_problem(held, self._param_problem, partial(_expected, optimizer))
        if reason is not None:
            return f"the held state: {reason.replace('incoming ', '')}"
        for index, param in enumerate(params_of(optimizer)):
            scales = optimizer._scales.get(param, {})
            for key, dtype in _expected(optimizer, param).items():
                scale = scales.get(key)
                if dtype == torch.bfloat16 and not (
                    isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.item() == 1.0
                ):
                    return f"parameter {index}: the scale of held {key} is not one"
        return None

    def _payload_problem(self, context: AdoptionContext) -> Optional[str]:
        """Each incoming value is the held tensor itself, or an FP32 value for a held BF16 state
        overlapping nothing held."""
        optimizer, given = context.optimizer, context.state_dict
        reason = param_groups_problem(optimizer, given) or self._held_problem(context)
        if reason is not None:
            return reason
        assert given is not None
        if len(given["state"]) != len(params_of(optimizer)):
            return "the incoming state does not hold exactly one entry per parameter"
        extents = held_extents(optimizer)
        for index, param, incoming in paired_state(optimizer, given):
            held = optimizer.state[param]
            if not isinstance(incoming, dict) or set(incoming) != set(held):
                return f"parameter {index}: the incoming state does not have the held keys"
            for key, value in incoming.items():
                if same_memory(value, held[key]):
                    continue
                reason = None if held[key].dtype == torch.bfloat16 else "is not the held tensor"
                reason = reason or tensor_problem(value, torch.float32, param)
                overlapped = None if reason else extents.add(value, f"incoming {key}")
                if reason or overlapped:
                    return f"parameter {index}: incoming {key} {reason or f'overlaps {overlapped}'}"
        return None


def _expected(optimizer: Any, param: torch.Tensor) -> ExpectedState:
    """The keys and dtypes TE's loader leaves for ``param``."""
    expected = dict.fromkeys(MOMENT_KEYS, torch.bfloat16)
    if optimizer.master_weights:
        remainders = optimizer.store_param_remainders and param.dtype == torch.bfloat16
        expected["master_param"] = torch.int16 if remainders else torch.float32
    return expected


def _store_as_te_loads(value: torch.Tensor, held: torch.Tensor) -> None:
    """Store ``value`` into ``held`` as TE's loader does: ``value.float().bfloat16()`` for a BF16
    state (round to nearest even, NaNs made canonical), in chunks; the held tensor of any other
    dtype is ``value`` itself."""
    if held.dtype != torch.bfloat16:
        return
    flat_value, flat_held = value.reshape(-1), held.reshape(-1)
    for start in range(0, flat_held.numel(), STORE_CHUNK_ELEMENTS):
        end = start + STORE_CHUNK_ELEMENTS
        flat_held[start:end].copy_(flat_value[start:end].float().bfloat16())
