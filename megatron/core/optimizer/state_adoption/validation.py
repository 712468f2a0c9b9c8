"""Side-effect-free checks for adopter authors; the built-in adopter is made of them.

Every check returns None when its rule holds and a human-readable reason otherwise, so an
adopter's ``decline_reason`` chains them with :func:`first_decline_reason`. Each public check
encodes a rule that an adopter must follow to leave the optimizer exactly as its own loader
would, and that is easy to get subtly wrong:

* :func:`owner_decline_reason` -- the ``DistributedOptimizer`` modes whose state layout the
  adopter cannot know (stub, Megatron-FSDP, CPU offload, the other precision mode);
* :func:`instance_method_decline_reason` -- a ``load_state_dict``/``state_dict`` set on the
  optimizer instance, which upstream would call;
* :func:`load_hooks_decline_reason` -- ``load_state_dict`` hooks PyTorch's loader would run;
* :func:`param_state_pairs` -- which incoming entry belongs to which parameter, as PyTorch's
  loader pairs them;
* :func:`one_entry_per_param_decline_reason`, :func:`state_entry_decline_reason` and
  :func:`incoming_state_decline_reason` -- matching param groups, exact keys, dtypes, devices,
  shapes and layouts, and no shared storage, which installing tensors by reference requires.
"""

from itertools import chain
from typing import Any, Callable, Iterable, Iterator, List, Mapping, Optional, Set, Tuple, Union

import torch

from .adopter import StateAdoptionContext, StateExportContext

__all__ = [
    "ExpectedState",
    "first_decline_reason",
    "incoming_state_decline_reason",
    "instance_method_decline_reason",
    "load_hooks_decline_reason",
    "one_entry_per_param_decline_reason",
    "owner_decline_reason",
    "param_state_pairs",
    "state_entry_decline_reason",
]

ExpectedState = Mapping[str, torch.dtype]
"""The state keys an adopter accepts for one parameter, each with the dtype it requires."""


def first_decline_reason(checks: Iterable[Callable[[], Optional[str]]]) -> Optional[str]:
    """Run ``checks`` in order and return the first reason, or None if all accept.

    Args:
        checks (Iterable[Callable[[], Optional[str]]]): zero-argument checks; later ones may
            rely on earlier ones having accepted.

    Returns:
        Optional[str]: the first decline reason, or None.
    """
    for check in checks:
        reason = check()
        if reason is not None:
            return reason
    return None


def owner_decline_reason(
    context: Union[StateAdoptionContext, StateExportContext], precision_aware: bool = False
) -> Optional[str]:
    """Decline stub, Megatron-FSDP and CPU-offloaded owners, and the other precision mode.

    Args:
        context (StateAdoptionContext or StateExportContext): the context to check.
        precision_aware (bool): whether the adopter handles the precision-aware optimizer
            (then it requires ``config.use_precision_aware_optimizer``) or not (then it
            requires that flag to be off).

    Returns:
        Optional[str]: None if the owner's mode fits, otherwise why not.
    """
    if context.is_stub_optimizer:
        return "the DistributedOptimizer is a stub"
    if context.config is None or context.ddp_config is None:
        return "the owner's OptimizerConfig or DistributedDataParallelConfig is unknown"
    owner_flags = (
        (context.ddp_config, "use_megatron_fsdp", False, "Megatron-FSDP manages the state"),
        (context.config, "optimizer_cpu_offload", False, "the optimizer is CPU-offloaded"),
        (
            context.config,
            "use_precision_aware_optimizer",
            precision_aware,
            "the optimizer is precision-aware",
        ),
    )
    for config, flag, required, meaning in owner_flags:
        if not hasattr(config, flag):
            return f"{type(config).__name__} has no '{flag}'"
        if bool(getattr(config, flag)) != required:
            return f"{flag} is set: {meaning}" if not required else f"{flag} is not set"
    return None


def instance_method_decline_reason(optimizer: torch.optim.Optimizer, method: str) -> Optional[str]:
    """Decline an optimizer whose *instance* carries its own ``method``.

    Upstream calls ``optimizer.load_state_dict(...)``/``optimizer.state_dict()``, which
    resolves an attribute set on the instance (by a wrapper, a debugging or conversion shim,
    or Megatron-Bridge's memory-efficient loading) before the class's method. Whatever that
    attribute does must happen, so no adopter may stand in for it.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer.
        method (str): ``"load_state_dict"`` or ``"state_dict"``.

    Returns:
        Optional[str]: None if ``method`` resolves to the class's, otherwise why not.
    """
    if method in getattr(optimizer, "__dict__", {}):
        return (
            f"the {type(optimizer).__name__} instance has its own {method} (set on the "
            "instance, e.g. by a wrapper), which upstream calls"
        )
    return None


def load_hooks_decline_reason(
    optimizer: torch.optim.Optimizer, allow_post_hooks: bool = True
) -> Optional[str]:
    """Decline optimizers with ``load_state_dict`` hooks an adopter could not honour.

    A pre-hook may rewrite the incoming state after it was validated, so it always declines.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer.
        allow_post_hooks (bool): False if the adopter does not run PyTorch's loader with
            the full state (post-hooks would then observe something else).

    Returns:
        Optional[str]: None if no hook stands in the way, otherwise why.
    """
    hook_kinds = [("_optimizer_load_state_dict_pre_hooks", "pre-hook")]
    if not allow_post_hooks:
        hook_kinds.append(("_optimizer_load_state_dict_post_hooks", "post-hook"))
    for attribute, kind in hook_kinds:
        hooks = getattr(optimizer, attribute, None)
        if hooks is None:
            return f"the optimizer's load_state_dict {kind}s cannot be inspected"
        if len(hooks) > 0:
            return f"a load_state_dict {kind} is registered and may rewrite the state"
    return None


def _param_groups_decline_reason(
    optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> Optional[str]:
    """Perform PyTorch's param-group validation without raising.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer.
        state_dict (Mapping[str, Any]): the incoming state dict.

    Returns:
        Optional[str]: None if group count and sizes match, otherwise the mismatch.
    """
    incoming_state = state_dict.get("state")
    incoming_groups = state_dict.get("param_groups")
    if not isinstance(incoming_state, Mapping) or not isinstance(incoming_groups, list):
        return "the state dict lacks a 'state' mapping or a 'param_groups' list"
    if len(incoming_groups) != len(optimizer.param_groups):
        return (
            f"the state dict has {len(incoming_groups)} param groups, "
            f"the optimizer {len(optimizer.param_groups)}"
        )
    for index, (incoming, group) in enumerate(zip(incoming_groups, optimizer.param_groups)):
        if not isinstance(incoming, Mapping) or not isinstance(incoming.get("params"), list):
            return f"param group {index} of the state dict has no 'params' list"
        if len(incoming["params"]) != len(group["params"]):
            return (
                f"param group {index} has {len(incoming['params'])} params in the state dict, "
                f"{len(group['params'])} in the optimizer"
            )
    return None


def _optimizer_params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Return every parameter of ``optimizer``, group by group, in PyTorch's state-dict order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def param_state_pairs(
    optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> Iterator[Tuple[int, torch.Tensor, Any]]:
    """Yield (position, parameter, incoming state) as PyTorch's loader pairs them.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer.
        state_dict (Mapping[str, Any]): the incoming state dict (groups already validated).

    Returns:
        Iterator[Tuple[int, torch.Tensor, Any]]: one item per parameter that has state.
    """
    incoming_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = _optimizer_params(optimizer)
    incoming_state = state_dict["state"]
    for index, (state_id, param) in enumerate(zip(incoming_ids, params)):
        if state_id in incoming_state:
            yield index, param, incoming_state[state_id]


def _storage_ptr(tensor: torch.Tensor) -> int:
    """Return the address of ``tensor``'s storage (0 for an empty storage)."""
    return int(tensor.untyped_storage().data_ptr())


def _plain_tensor_decline_reason(
    tensor: Any, dtype: torch.dtype, like: torch.Tensor
) -> Optional[str]:
    """Accept a dense, contiguous ``dtype`` tensor placed and shaped like ``like``.

    Args:
        tensor (Any): the incoming value.
        dtype (torch.dtype): the dtype it must have.
        like (torch.Tensor): the parameter whose device and shape it must have.

    Returns:
        Optional[str]: None if acceptable, otherwise what is wrong with it.
    """
    if type(tensor) is not torch.Tensor:
        return f"is a {type(tensor).__name__}, not a plain torch.Tensor"
    if tensor.is_quantized:
        return "is quantized"
    if tensor.layout != torch.strided:
        return f"has layout {tensor.layout}, not torch.strided"
    if tensor.dtype != dtype:
        return f"is {tensor.dtype}, not {dtype}"
    if tensor.device != like.device:
        return f"is on {tensor.device}, the parameter on {like.device}"
    if tensor.shape != like.shape:
        return f"has shape {tuple(tensor.shape)}, the parameter {tuple(like.shape)}"
    if not tensor.is_contiguous():
        return "is not contiguous"
    if tensor.requires_grad:
        return "requires grad"
    return None


def one_entry_per_param_decline_reason(
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    param_decline_reason: Callable[[torch.Tensor], Optional[str]],
) -> Optional[str]:
    """Require matching param groups, accepted parameters and one state entry per parameter.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer.
        state_dict (Mapping[str, Any]): the incoming state dict.
        param_decline_reason (Callable): the adopter's rule for one parameter.

    Returns:
        Optional[str]: None if every parameter is accepted and has exactly one incoming state
        entry, otherwise the first problem.
    """
    reason = _param_groups_decline_reason(optimizer, state_dict)
    if reason is not None:
        return reason
    params = _optimizer_params(optimizer)
    for index, param in enumerate(params):
        reason = param_decline_reason(param)
        if reason is not None:
            return f"parameter {index}: {reason}"
    pairs = sum(1 for _ in param_state_pairs(optimizer, state_dict))
    if len(state_dict["state"]) != pairs or pairs != len(params):
        return "the incoming state does not hold exactly one entry per parameter"
    return None


def incoming_state_decline_reason(
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    param_decline_reason: Callable[[torch.Tensor], Optional[str]],
    expected_state: Callable[[torch.Tensor], ExpectedState],
) -> Optional[str]:
    """Check groups, parameters and every incoming state tensor for by-reference adoption.

    Requires :func:`one_entry_per_param_decline_reason`, each entry with exactly the keys of
    ``expected_state(param)``,
    each a tensor accepted by a dense, contiguous tensor with the expected dtype,
    and no two state tensors or a state tensor and a parameter sharing a storage.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer.
        state_dict (Mapping[str, Any]): the incoming state dict.
        param_decline_reason (Callable): the adopter's rule for one parameter.
        expected_state (Callable): the keys and dtypes accepted for one parameter.

    Returns:
        Optional[str]: None if everything can be adopted, otherwise the first problem.
    """
    reason = one_entry_per_param_decline_reason(optimizer, state_dict, param_decline_reason)
    if reason is not None:
        return reason
    params = _optimizer_params(optimizer)
    pairs = list(param_state_pairs(optimizer, state_dict))
    seen_storages: Set[int] = {_storage_ptr(p) for p in params if p.nbytes > 0}
    for index, param, incoming in pairs:
        reason = state_entry_decline_reason(param, incoming, expected_state(param), seen_storages)
        if reason is not None:
            return f"parameter {index}: {reason}"
    return None


def state_entry_decline_reason(
    param: torch.Tensor,
    entry: Any,
    expected: ExpectedState,
    seen_storages: Set[int],
    label: str = "incoming",
) -> Optional[str]:
    """Check one parameter's state entry; add its tensors' storages to ``seen_storages``.

    Args:
        param (torch.Tensor): the parameter the entry belongs to.
        entry (Any): its state (incoming or held): must map exactly the keys of ``expected``.
        expected (ExpectedState): the keys and dtypes it must have.
        seen_storages (Set[int]): storages no tensor of the entry may share (parameters',
            other entries'); updated.
        label (str): which state the entry is, for the messages ("incoming", "held").

    Returns:
        Optional[str]: None if every tensor is acceptable, otherwise what is wrong.
    """
    if not isinstance(entry, Mapping):
        return f"the {label} state is a {type(entry).__name__}, not a dict"
    if set(entry.keys()) != set(expected):
        return f"the {label} state has keys {sorted(map(str, entry))}, not {sorted(expected)}"
    for key, dtype in expected.items():
        reason = _plain_tensor_decline_reason(entry[key], dtype, param)
        if reason is not None:
            return f"{key} {reason}"
        if entry[key].nbytes > 0:
            storage = _storage_ptr(entry[key])
            if storage in seen_storages:
                return f"{key} shares storage with a parameter or another state tensor"
            seen_storages.add(storage)
    return None
