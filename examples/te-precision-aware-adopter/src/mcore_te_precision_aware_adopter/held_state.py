"""Whether an incoming state dict is, bit for bit, the state FusedAdam already holds.

Megatron-Core's second load pass hands FusedAdam its own ``state_dict()``: TE returns every
BF16 moment as an FP32 copy and the master weights (FP32, or int16 remainders) as the held
tensors themselves. TE's loader then rebuilds the whole state from it — new BF16 tensors with
the rounded values, new master tensors with copied values — although the result equals what
it already holds. These checks prove that equality without allocating more than one chunk.
"""

from typing import Any, Callable, Mapping, Optional, Set

import torch

from megatron.core.optimizer.state_adoption.validation import (
    ExpectedState,
    param_groups_decline_reason,
    param_state_pairs,
    plain_tensor_decline_reason,
    storage_ptr,
)

#: Elements compared per chunk: bounds the comparison's transient memory (12 MiB for FP32→BF16).
COMPARE_CHUNK_ELEMENTS = 1 << 22

_SAME_WIDTH_INTEGER = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.int16: torch.int16,
    torch.float32: torch.int32,
}


def incoming_dtype_for(held_dtype: torch.dtype) -> torch.dtype:
    """The dtype FusedAdam's ``state_dict()`` returns for a state held in ``held_dtype``."""
    return torch.int16 if held_dtype == torch.int16 else torch.float32


def loads_to_held_bits(
    incoming: torch.Tensor, held: torch.Tensor, chunk_elements: int = COMPARE_CHUNK_ELEMENTS
) -> bool:
    """Whether TE's loader, given ``incoming``, would store exactly the bits of ``held``.

    TE stores an FP32 value into a BF16 state with ``copy_(value.bfloat16())`` (round to
    nearest even) and an FP32 or int16 value into a state of the same dtype unchanged.

    Args:
        incoming (torch.Tensor): the offered value (FP32, or int16 remainders).
        held (torch.Tensor): the state tensor it would replace; same shape and device.
        chunk_elements (int): elements cast and compared at a time.

    Returns:
        bool: True if every element's bit pattern would be unchanged (NaNs included).
    """
    if incoming is held:
        return True
    bits = _SAME_WIDTH_INTEGER[held.dtype]
    flat_incoming, flat_held = incoming.reshape(-1), held.reshape(-1)
    for start in range(0, flat_held.numel(), chunk_elements):
        end = start + chunk_elements
        stored = flat_incoming[start:end].to(held.dtype)
        if not torch.equal(stored.view(bits), flat_held[start:end].view(bits)):
            return False
    return True


def held_state_decline_reason(
    optimizer: Any,
    state_dict: Mapping[str, Any],
    param_decline_reason: Callable[[torch.Tensor], Optional[str]],
    expected_state: Callable[[torch.Tensor], ExpectedState],
) -> Optional[str]:
    """Accept ``state_dict`` only if TE's loader would leave the held state bit for bit.

    Requires matching param groups, every parameter accepted by ``param_decline_reason``,
    one incoming entry per parameter, a held state with exactly the keys and dtypes of
    ``expected_state(param)`` in plain tensors shaped like the parameter (no two sharing a
    storage with each other or a parameter), incoming values in the dtypes FusedAdam's
    ``state_dict()`` produces that load to the held bits, and each non-FP32 state's scale
    equal to one (what TE's loader would reset it to).

    Args:
        optimizer (Any): the TE FusedAdam (its type and settings already checked).
        state_dict (Mapping[str, Any]): the incoming state dict.
        param_decline_reason (Callable): the adopter's rule for one parameter.
        expected_state (Callable): the held keys and dtypes for one parameter.

    Returns:
        Optional[str]: None if the held state can be kept, otherwise the first difference.
    """
    reason = param_groups_decline_reason(optimizer, state_dict)
    if reason is not None:
        return reason
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        reason = param_decline_reason(param)
        if reason is not None:
            return f"parameter {index}: {reason}"
    pairs = list(param_state_pairs(optimizer, state_dict))
    if len(state_dict["state"]) != len(pairs) or len(pairs) != len(params):
        return "the incoming state does not hold exactly one entry per parameter"
    scales = getattr(optimizer, "_scales", None)
    if not isinstance(scales, Mapping):
        return "FusedAdam has no _scales mapping to compare with"
    seen_storages: Set[int] = {storage_ptr(p) for p in params if p.nbytes > 0}
    for index, param, incoming in pairs:
        reason = _entry_decline_reason(
            param, incoming, optimizer.state.get(param), expected_state(param), scales, seen_storages
        )
        if reason is not None:
            return f"parameter {index}: {reason}"
    return None


def _entry_decline_reason(
    param: torch.Tensor,
    incoming: Any,
    held: Any,
    expected: ExpectedState,
    scales: Mapping[Any, Any],
    seen_storages: Set[int],
) -> Optional[str]:
    """Check one parameter's held state against its incoming state."""
    if not isinstance(held, dict) or set(held) != set(expected):
        keys = sorted(map(str, held)) if isinstance(held, Mapping) else None
        return f"the held state has keys {keys}, not {sorted(expected)}"
    if not isinstance(incoming, Mapping) or set(incoming) != set(expected):
        return f"the incoming state does not have exactly the keys {sorted(expected)}"
    for key, dtype in expected.items():
        reason = plain_tensor_decline_reason(held[key], dtype, param)
        if reason is not None:
            return f"held {key} {reason}"
        reason = plain_tensor_decline_reason(incoming[key], incoming_dtype_for(dtype), param)
        if reason is not None:
            return f"incoming {key} {reason}"
        if held[key].nbytes > 0:
            storage = storage_ptr(held[key])
            if storage in seen_storages:
                return f"held {key} shares storage with a parameter or another state tensor"
            seen_storages.add(storage)
        if dtype not in (torch.float32, torch.int16):
            scale = scales.get(param, {}).get(key)
            if not (
                isinstance(scale, torch.Tensor)
                and scale.dtype == torch.float32
                and scale.numel() == 1
                and scale.item() == 1.0
            ):
                return f"the scale of {key} is not one"
        if not loads_to_held_bits(incoming[key], held[key]):
            return f"incoming {key} differs from the held state"
    return None
