"""Opt-in adopter for TE FusedAdam with BF16 moments (the precision-aware optimizer).

Not registered by default (register it, or install a plugin that names it). A resume of a
``dp_reshardable`` checkpoint allocates, over the held state (BF16 moments, FP32 master weights
or int16 remainders: 6 bytes per parameter), an FP32 copy of each moment to read into, TE's FP32
copies in ``state_dict()`` and a whole new state in TE's loader. This adopter, in each role:

* scaffold load (pass 1): installs MCore's freshly allocated state by reference, with the scale
  of one TE's loader gives each BF16 state;
* export: supplies PyTorch's state dict, the held tensors themselves (no FP32 copies);
* read: supplies the held BF16 moments as read targets; ``torch_dist`` casts the checkpoint's
  FP32 values into them in place, bit for bit TE's ``copy_(fp32.bfloat16())``;
* payload load (pass 2): keeps the held tensors and stores TE's conversion of each FP32 value
  into the BF16 tensor held already, in chunks.

Anything it cannot prove equal to TE's result is declined: FP16/FP8 moments (TE scales them),
non-FP32 master weights, DTensor or non-floating parameters, a held state TE would lay out
otherwise, and an optimizer that has stepped (its held state may be trained state, which a read
failing midway would leave half overwritten).
"""

from typing import Any, Dict, Optional

import torch

from .adopter import AdoptionContext, StateAdopter
from .checks import (
    ExpectedState,
    Extents,
    first_problem,
    incoming_state_problem,
    owner_problem,
    paired_state,
    param_groups_problem,
    params_of,
    same_memory,
    tensor_problem,
)
from .te_fused_adam import MOMENT_KEYS, fused_adam_problem

__all__ = ["TEFusedAdamPrecisionAwareStateAdopter"]

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
        if reason is not None:
            return reason
        payload = self._payload_problem(context)
        if payload is None:
            return None
        scaffold = incoming_state_problem(
            context, self._param_problem, lambda param: _expected(context.optimizer, param)
        )
        if scaffold is None:
            return None
        return f"not a payload for the held state ({payload}); not a scaffold ({scaffold})"

    def adopt(self, context: AdoptionContext) -> None:
        """Install the scaffold by reference, or store the payload into the held tensors."""
        optimizer: Any = context.optimizer
        assert context.state_dict is not None
        pairs = list(paired_state(optimizer, context.state_dict))
        payload = self._payload_problem(context) is None
        held = {id(param): optimizer.state.get(param) for _, param, _ in pairs}
        # PyTorch's loader would cast master weights to the BF16 parameters' dtype: groups only.
        groups = list(context.state_dict["param_groups"])
        torch.optim.Optimizer.load_state_dict(optimizer, {"state": {}, "param_groups": groups})
        for _, param, incoming in pairs:
            if payload:
                optimizer.state[param] = held[id(param)]
                for key, value in incoming.items():
                    _store_as_te_loads(value, held[id(param)][key])
            else:
                optimizer.state[param] = dict(incoming)
                scales = optimizer._scales.setdefault(param, {})
                for key in incoming:  # TE's _initialize_state gives every non-FP32 state a scale
                    if optimizer.name_to_dtype_map[key] != torch.float32:
                        scales[key] = torch.ones([1], dtype=torch.float32, device=param.device)

    def export_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Accept a held state laid out as TE's loader leaves it, every scale one."""
        return first_problem(
            lambda: self._mode_problem(context), lambda: self._held_problem(context)
        )

    def export_state_dict(self, context: AdoptionContext) -> Dict[str, Any]:
        """PyTorch's state dict of the FusedAdam: its groups and the held tensors themselves."""
        state_dict: Dict[str, Any] = torch.optim.Optimizer.state_dict(context.optimizer)
        state_dict["state"] = {key: dict(entry) for key, entry in state_dict["state"].items()}
        return state_dict

    def read_target_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Accept what the export accepts, for an optimizer that has not stepped."""
        for index, group in enumerate(context.optimizer.param_groups):
            if group.get("step"):
                return f"param group {index} has stepped: its state may be trained state"
        return self.export_decline_reason(context)

    def read_target(self, context: AdoptionContext, param: torch.Tensor, name: str) -> torch.Tensor:
        """The held BF16 moment itself; TE's own tensor (the held one) for master weights."""
        optimizer: Any = context.optimizer
        target: torch.Tensor = (
            optimizer.state[param][name]
            if name in MOMENT_KEYS
            else optimizer.get_unscaled_state(param, name)
        )
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
            for key in MOMENT_KEYS:
                if dtypes.get(key) is not torch.bfloat16:
                    return (
                        f"FusedAdam keeps {key} in {dtypes.get(key)}; only BF16 moments are adopted"
                    )
            if optimizer.master_weights and dtypes.get("master_param") is not torch.float32:
                return f"FusedAdam keeps master weights in {dtypes.get('master_param')}, not torch.float32"
            return None

        return first_problem(
            lambda: owner_problem(context, precision_aware=True),
            lambda: fused_adam_problem(optimizer, self._fused_adam_class),
            settings_problem,
            lambda: next(
                filter(None, (self._param_problem(p) for p in params_of(optimizer))), None
            ),
        )

    def _param_problem(self, param: torch.Tensor) -> Optional[str]:
        """Accept plain floating-point parameters on the device type."""
        if type(param) not in (torch.Tensor, torch.nn.Parameter):
            return f"a parameter is a {type(param).__name__}, not a plain tensor"
        if not param.is_floating_point() or param.device.type != self._device_type:
            return f"a parameter is {param.dtype} on {param.device}"
        return None

    def _held_problem(self, context: AdoptionContext) -> Optional[str]:
        """Every parameter holds the state TE's loader lays out, with scales of one, no two
        tensors overlapping."""
        optimizer: Any = context.optimizer
        if not optimizer.state:
            return "the optimizer holds no state yet"
        extents = Extents()
        for index, param in enumerate(params_of(optimizer)):
            extents.add(param, f"parameter {index}")
        for index, param in enumerate(params_of(optimizer)):
            held, expected = optimizer.state.get(param), _expected(optimizer, param)
            if not isinstance(held, dict) or set(held) != set(expected):
                return (
                    f"parameter {index}: the held state does not have the keys {sorted(expected)}"
                )
            for key, dtype in expected.items():
                reason = tensor_problem(held[key], dtype, param)
                overlapped = extents.add(held[key], f"held {key} of parameter {index}")
                if reason is None and overlapped is not None:
                    reason = f"overlaps {overlapped}"
                scale = optimizer._scales.get(param, {}).get(key)
                if reason is None and dtype == torch.bfloat16 and not _is_one(scale):
                    reason = "has a scale other than one"
                if reason is not None:
                    return f"parameter {index}: held {key} {reason}"
        return None

    def _payload_problem(self, context: AdoptionContext) -> Optional[str]:
        """The incoming values can be stored into the held state: each the held tensor itself,
        or an FP32 value for a BF16 state overlapping nothing held."""
        optimizer, state_dict = context.optimizer, context.state_dict
        reason = param_groups_problem(optimizer, state_dict) or self._held_problem(context)
        if reason is not None:
            return reason
        assert state_dict is not None
        extents = Extents()
        for index, param in enumerate(params_of(optimizer)):
            extents.add(param, f"parameter {index}")
            for key, value in optimizer.state[param].items():
                extents.add(value, f"held {key} of parameter {index}")
        for index, param, incoming in paired_state(optimizer, state_dict):
            held = optimizer.state[param]
            if not isinstance(incoming, dict) or set(incoming) != set(held):
                return f"parameter {index}: the incoming state does not have the held keys"
            for key, value in incoming.items():
                if same_memory(value, held[key]):
                    continue
                reason = None if held[key].dtype == torch.bfloat16 else "is not the held tensor"
                reason = reason or tensor_problem(value, torch.float32, param)
                overlapped = extents.add(value, f"incoming {key}") if reason is None else None
                if reason or overlapped:
                    return f"parameter {index}: incoming {key} {reason or f'overlaps {overlapped}'}"
        if len(state_dict["state"]) != len(params_of(optimizer)):
            return "the incoming state does not hold exactly one entry per parameter"
        return None


def _expected(optimizer: Any, param: torch.Tensor) -> ExpectedState:
    """The keys and dtypes TE's loader leaves for ``param``."""
    expected = dict.fromkeys(MOMENT_KEYS, torch.bfloat16)
    if optimizer.master_weights:
        remainders = optimizer.store_param_remainders and param.dtype == torch.bfloat16
        expected["master_param"] = torch.int16 if remainders else torch.float32
    return expected


def _is_one(scale: Any) -> bool:
    """Whether ``scale`` is TE's scale of one: one FP32 element equal to 1."""
    return (
        isinstance(scale, torch.Tensor)
        and scale.dtype == torch.float32
        and scale.numel() == 1
        and scale.item() == 1.0
    )


def _store_as_te_loads(value: torch.Tensor, held: torch.Tensor) -> None:
    """Store ``value`` into ``held`` as TE's loader does: ``value.float().bfloat16()`` for a BF16
    state (round to nearest even, NaNs made canonical), nothing for the held tensor of any other
    dtype, in chunks of :data:`STORE_CHUNK_ELEMENTS`."""
    if held.dtype != torch.bfloat16:
        return  # the held FP32 or int16 tensor itself
    flat_value, flat_held = value.reshape(-1), held.reshape(-1)
    for start in range(0, flat_held.numel(), STORE_CHUNK_ELEMENTS):
        end = start + STORE_CHUNK_ELEMENTS
        flat_held[start:end].copy_(flat_value[start:end].float().bfloat16())
