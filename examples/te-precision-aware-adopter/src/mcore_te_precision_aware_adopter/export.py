"""Export FusedAdam's held state as it is, for the state dict MCore reads at the start of a load.

``DistributedOptimizer.load_state_dict`` reads the inner optimizer's ``state_dict()`` to pair
param groups and, in the payload pass, to hand the state straight back to ``load_state_dict``
(the checkpoint's values are written into the state afterwards). TE's ``state_dict()`` returns
an FP32 copy of every BF16 moment: 8 bytes per parameter that stay alive across the load peak.
PyTorch's ``Optimizer.state_dict()`` -- which TE's runs first, hooks included -- returns the
same param groups and the held tensors themselves. Every loader turns those into the same bits
as the FP32 copies: TE's converts each value with ``.float()`` and then back to BF16 (exact),
and this package's adopter keeps them. That holds while every BF16 state's scale is one, which
is checked.
"""

from typing import Any, Callable, Dict, Mapping, Optional, Set

import torch

from megatron.core.optimizer.state_adoption.validation import ExpectedState

from .held_state import held_entry_decline_reason, optimizer_params, storage_ptr


def held_state_export_decline_reason(
    optimizer: Any,
    param_decline_reason: Callable[[torch.Tensor], Optional[str]],
    expected_state: Callable[[torch.Tensor], ExpectedState],
) -> Optional[str]:
    """Accept an optimizer whose every parameter holds the state TE lays out, scales one.

    Args:
        optimizer (Any): the TE FusedAdam (its type and settings already checked).
        param_decline_reason (Callable): the adopter's rule for one parameter.
        expected_state (Callable): the held keys and dtypes for one parameter.

    Returns:
        Optional[str]: None if the held tensors can stand in for TE's FP32 copies.
    """
    params = optimizer_params(optimizer)
    if not optimizer.state:
        return "the optimizer holds no state yet (its state_dict() copies nothing)"
    scales = getattr(optimizer, "_scales", None)
    if not isinstance(scales, Mapping):
        return "FusedAdam has no _scales mapping to compare with"
    seen_storages: Set[int] = {storage_ptr(p) for p in params if p.nbytes > 0}
    for index, param in enumerate(params):
        reason = param_decline_reason(param)
        if reason is None:
            reason = held_entry_decline_reason(
                param, optimizer.state.get(param), expected_state(param), scales, seen_storages
            )
        if reason is not None:
            return f"parameter {index}: {reason}"
    return None


def state_dict_of_held_tensors(optimizer: Any) -> Dict[str, Any]:
    """PyTorch's state dict of ``optimizer``: its param groups and the held tensors themselves.

    Args:
        optimizer (Any): a FusedAdam accepted by :func:`held_state_export_decline_reason`.

    Returns:
        Dict[str, Any]: the state dict; each parameter's entry is a new dict holding the held
        tensors (TE's ``state_dict()`` would have made FP32 copies of the BF16 ones).
    """
    state_dict: Dict[str, Any] = torch.optim.Optimizer.state_dict(optimizer)
    # PyTorch packs the optimizer's own per-parameter dicts; callers get their own copies.
    state_dict["state"] = {key: dict(entry) for key, entry in state_dict["state"].items()}
    return state_dict
