"""Load MCore's payload pass into the tensors FusedAdam already holds, exactly as TE would.

Megatron-Core's second load pass hands FusedAdam the state dict it read at the start of the
load: this package's export (the held tensors themselves) or, without it, TE's own
``state_dict()``, which returns every BF16 moment as an FP32 copy and the master weights (FP32,
or int16 remainders) as the held tensors themselves. TE's loader then allocates a whole new
state -- one more state shard at the load peak -- and stores each value with
``copy_(value.bfloat16())`` (BF16 states) or ``copy_(value)`` (FP32 and int16 states). Keeping
the held tensors, or storing the same conversions chunk by chunk into them, gives the same bits
without the new state.
"""

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set

import torch

from megatron.core.optimizer.state_adoption.validation import (
    ExpectedState,
    one_entry_per_param_decline_reason,
    param_state_pairs,
    state_entry_decline_reason,
)

#: Elements converted per chunk: bounds the transient of a BF16 store to 8 MiB.
STORE_CHUNK_ELEMENTS = 1 << 22


def optimizer_params(optimizer: Any) -> List[torch.Tensor]:
    """Every parameter of ``optimizer``, group by group (PyTorch's state-dict order)."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def storage_ptr(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage."""
    return int(tensor.untyped_storage().data_ptr())


def load_into_held_state(
    held: Dict[str, torch.Tensor], incoming: Mapping[str, torch.Tensor]
) -> None:
    """Load one parameter's accepted payload: convert into BF16 states, install the rest.

    An incoming tensor of the held dtype that is not the held tensor (FP32 master weights,
    int16 remainders) is installed by reference. Everything else -- an FP32 value for a BF16
    state, or the held tensor itself -- is stored into the held tensor with TE's conversion.

    Args:
        held (Dict[str, torch.Tensor]): the parameter's state dict, updated in place.
        incoming (Mapping[str, torch.Tensor]): its checked incoming state.
    """
    for key, value in incoming.items():
        if value is not held[key] and value.dtype == held[key].dtype:
            held[key] = value
        else:
            store_as_te_loads(value, held[key])


def create_scales_as_te_loads(optimizer: Any, param: torch.Tensor, keys: Iterable[str]) -> None:
    """Give ``param``'s states the scales TE's loader creates with them.

    TE's ``load_state_dict`` allocates every state it loads (``FusedAdam._initialize_state``),
    which also puts a scale of one (FP32, one element, on the parameter's device) into
    ``FusedAdam._scales[param][key]`` for every state whose configured dtype is not FP32; its
    BF16 conversion leaves it at one. An adopter that installs the incoming tensors instead
    creates the same entries in the same mapping -- the mapping whose layout the checks of this
    package already require -- and allocates no state (TE's public ``initialize_state`` would
    allocate all of one parameter's state, a transient of 6 bytes per element of the largest
    parameter at the load peak).

    Args:
        optimizer (Any): the TE FusedAdam (its type, settings and ``_scales`` checked).
        param (torch.Tensor): the parameter whose state was installed.
        keys (Iterable[str]): the names of the installed states.
    """
    scales = optimizer._scales.setdefault(param, {})
    for key in keys:
        if optimizer.name_to_dtype_map[key] != torch.float32:
            scales[key] = torch.ones([1], dtype=torch.float32, device=param.device)


def incoming_dtype_for(held_dtype: torch.dtype) -> torch.dtype:
    """The dtype FusedAdam's ``state_dict()`` returns for a state held in ``held_dtype``."""
    return torch.int16 if held_dtype == torch.int16 else torch.float32


def store_as_te_loads(
    incoming: torch.Tensor, held: torch.Tensor, chunk_elements: int = STORE_CHUNK_ELEMENTS
) -> None:
    """Store ``incoming`` into ``held`` with the conversion TE's loader applies.

    BF16 states get ``value.float().bfloat16()`` (round to nearest even, NaNs made canonical),
    FP32 and int16 states the value unchanged. ``incoming`` is either ``held`` itself (then a
    BF16 state is converted in place and anything else is left as it is) or shares no storage
    with it.

    Args:
        incoming (torch.Tensor): the offered value (FP32, or int16 remainders).
        held (torch.Tensor): the state tensor to overwrite; same shape and device.
        chunk_elements (int): elements converted at a time.
    """
    converts = held.dtype == torch.bfloat16
    if incoming is held and not converts:
        return
    flat_incoming, flat_held = incoming.reshape(-1), held.reshape(-1)
    for start in range(0, flat_held.numel(), chunk_elements):
        end = start + chunk_elements
        value = flat_incoming[start:end]
        if converts:
            value = value.float().bfloat16()
        flat_held[start:end].copy_(value)


def held_state_decline_reason(
    optimizer: Any,
    state_dict: Mapping[str, Any],
    param_decline_reason: Callable[[torch.Tensor], Optional[str]],
    expected_state: Callable[[torch.Tensor], ExpectedState],
) -> Optional[str]:
    """Accept ``state_dict`` if loading it with :func:`load_into_held_state` equals TE's result.

    Requires :func:`one_entry_per_param_decline_reason` (matching groups, every parameter
    accepted by ``param_decline_reason``, one incoming entry per parameter), a held state
    with exactly the keys and dtypes of ``expected_state(param)`` in plain tensors shaped like
    the parameter (no two sharing a storage with each other or a parameter), each non-FP32
    state's scale equal to one (what TE's loader resets it to), and incoming values that are
    either the held tensors themselves (this package's export) or in the dtypes FusedAdam's
    ``state_dict()`` produces, sharing no storage with any held tensor (nor, if it is to be
    installed by reference, with a parameter or another such tensor).

    Args:
        optimizer (Any): the TE FusedAdam (its type and settings already checked).
        state_dict (Mapping[str, Any]): the incoming state dict.
        param_decline_reason (Callable): the adopter's rule for one parameter.
        expected_state (Callable): the held keys and dtypes for one parameter.

    Returns:
        Optional[str]: None if the held state can take the values, otherwise why not.
    """
    reason = one_entry_per_param_decline_reason(optimizer, state_dict, param_decline_reason)
    if reason is not None:
        return reason
    params = optimizer_params(optimizer)
    pairs = list(param_state_pairs(optimizer, state_dict))
    scales = getattr(optimizer, "_scales", None)
    if not isinstance(scales, Mapping):
        return "FusedAdam has no _scales mapping to compare with"
    param_storages = {storage_ptr(p) for p in params if p.nbytes > 0}
    seen_storages = set(param_storages)
    held_states = [optimizer.state.get(param) for _, param, _ in pairs]
    for (index, param, incoming), held in zip(pairs, held_states):
        reason = held_entry_decline_reason(
            param, held, expected_state(param), scales, seen_storages
        )
        if reason is None:
            reason = _incoming_entry_decline_reason(param, incoming, held)
        if reason is not None:
            return f"parameter {index}: {reason}"
    held_storages = seen_storages - param_storages
    adopted_storages: Set[int] = set()
    for (index, _, incoming), held in zip(pairs, held_states):  # now every held storage is known
        for key, value in incoming.items():
            if value is held[key] or value.nbytes == 0:
                continue
            storage = storage_ptr(value)
            if storage in held_storages:
                return f"parameter {index}: incoming {key} shares storage with a held state tensor"
            if value.dtype == held[key].dtype:  # installed by reference
                if storage in param_storages or storage in adopted_storages:
                    return (
                        f"parameter {index}: incoming {key} shares storage with a parameter or "
                        "another incoming tensor"
                    )
                adopted_storages.add(storage)
    return None


def held_entry_decline_reason(
    param: torch.Tensor,
    held: Any,
    expected: ExpectedState,
    scales: Mapping[Any, Any],
    seen_storages: Set[int],
) -> Optional[str]:
    """Check one parameter's held state; add its storages to ``seen_storages``.

    Args:
        param (torch.Tensor): the parameter.
        held (Any): its held state (None if it has none).
        expected (ExpectedState): the keys and dtypes TE lays out for it.
        scales (Mapping[Any, Any]): FusedAdam's per-parameter state scales.
        seen_storages (Set[int]): storages no held tensor may share; updated.

    Returns:
        Optional[str]: None if the held state is what TE's loader would leave, else why not.
    """
    if held is not None and not isinstance(held, dict):
        return f"the held state is a {type(held).__name__}, not a dict"
    reason = state_entry_decline_reason(param, held or {}, expected, seen_storages, "held")
    if reason is not None:
        return reason if reason.startswith("the held") else f"held {reason}"
    for key, dtype in expected.items():
        if dtype not in (torch.float32, torch.int16):
            scale = scales.get(param, {}).get(key)
            if not (
                isinstance(scale, torch.Tensor)
                and scale.dtype == torch.float32
                and scale.numel() == 1
                and scale.item() == 1.0
            ):
                return f"the scale of {key} is not one"
    return None


def _incoming_entry_decline_reason(
    param: torch.Tensor, incoming: Any, held: Mapping[str, torch.Tensor]
) -> Optional[str]:
    """Check one parameter's incoming state against its (checked) held state."""
    if not isinstance(incoming, Mapping) or set(incoming) != set(held):
        return f"the incoming state does not have exactly the keys {sorted(held)}"
    converted = {key: value for key, value in incoming.items() if value is not held[key]}
    expected = {key: incoming_dtype_for(held[key].dtype) for key in converted}
    reason = state_entry_decline_reason(param, converted, expected, set(), "incoming")
    return None if reason is None or reason.startswith("the incoming") else f"incoming {reason}"
