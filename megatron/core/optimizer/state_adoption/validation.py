"""Side-effect-free checks for adopter authors; the built-in adopter is made of them.

Every check returns None when its rule holds and a human-readable reason otherwise, so an
adopter's ``decline_reason`` chains them with :func:`first_decline_reason`. Each public check
encodes a rule that an adopter must follow to leave the optimizer exactly as its own loader
would, and that is easy to get subtly wrong:

* :func:`owner_decline_reason` -- the owner modes whose state layout the adopter cannot know
  (stub, CPU offload, the other precision mode, Megatron-FSDP unless it asks for it);
* :func:`param_state_pairs` -- which incoming entry belongs to which parameter, as PyTorch's
  loader pairs them;
* :func:`one_entry_per_param_decline_reason`, :func:`state_entry_decline_reason` and
  :func:`incoming_state_decline_reason` -- matching param groups, exact keys, dtypes, devices,
  shapes and layouts, and no shared storage, which installing tensors by reference requires;
* :func:`exported_state_dict_decline_reason` -- an export is the optimizer's state as it holds
  it (the loader applies it to every export);
* :func:`installed_state_decline_reason` -- what every loader leaves right (parameters in their
  groups, the groups' hyper-parameters, state for exactly the right parameters and keys; the
  loader applies it after every ``adopt``).

The rules every adopter gets without asking (no hooks, no method set on the instance) are
enforced by the loader, not here.
"""

from itertools import chain
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
    Union,
)

import torch

from .adopter import StateAdoptionContext, StateExportContext

__all__ = [
    "ExpectedState",
    "exported_state_dict_decline_reason",
    "first_decline_reason",
    "incoming_state_decline_reason",
    "installed_state_decline_reason",
    "one_entry_per_param_decline_reason",
    "owner_decline_reason",
    "param_state_pairs",
    "state_entry_decline_reason",
]

ExpectedState = Mapping[str, torch.dtype]
"""The state keys an adopter accepts for one parameter, each with the dtype it requires."""

_ParamRule = Callable[[torch.Tensor], Optional[str]]
_EntryRule = Callable[[torch.Tensor, Any], Optional[str]]


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
    context: Union[StateAdoptionContext, StateExportContext],
    precision_aware: bool = False,
    megatron_fsdp: bool = False,
) -> Optional[str]:
    """Decline stub and CPU-offloaded owners, the other precision mode, and Megatron-FSDP
    unless the adopter handles it.

    An owner without a ``DistributedDataParallelConfig`` (``context.ddp_config`` is None) is one
    of the non-distributed optimizers (``Float16OptimizerWithFloat16Params``,
    ``FP32Optimizer``), whose inner optimizer holds the whole state of its parameters.

    Args:
        context (StateAdoptionContext or StateExportContext): the context to check.
        precision_aware (bool): whether the adopter handles the precision-aware optimizer
            (then it requires ``config.use_precision_aware_optimizer``) or not (then it
            requires that flag to be off).
        megatron_fsdp (bool): whether the adopter also handles Megatron-FSDP
            (``ddp_config.use_megatron_fsdp``), whose state is DTensors of local shards.

    Returns:
        Optional[str]: None if the owner's mode fits, otherwise why not.
    """
    if context.is_stub_optimizer:
        return "the DistributedOptimizer is a stub"
    if context.config is None:
        return "the owner's OptimizerConfig is unknown"
    owner_flags = [
        (context.config, "optimizer_cpu_offload", False, "the optimizer is CPU-offloaded"),
        (
            context.config,
            "use_precision_aware_optimizer",
            precision_aware,
            "the optimizer is precision-aware",
        ),
    ]
    if context.ddp_config is not None and not megatron_fsdp:
        owner_flags.insert(
            0, (context.ddp_config, "use_megatron_fsdp", False, "Megatron-FSDP manages the state")
        )
    for config, flag, required, meaning in owner_flags:
        if not hasattr(config, flag):
            return f"{type(config).__name__} has no '{flag}'"
        if bool(getattr(config, flag)) != required:
            return f"{flag} is set: {meaning}" if not required else f"{flag} is not set"
    return None


def _param_groups_decline_reason(
    optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> Optional[str]:
    """Perform PyTorch's param-group validation (count and sizes) without raising."""
    incoming_state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    incoming_groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
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
    incoming_state = state_dict["state"]
    for index, (state_id, param) in enumerate(zip(incoming_ids, _optimizer_params(optimizer))):
        if state_id in incoming_state:
            yield index, param, incoming_state[state_id]


def _dtensor_class() -> Optional[type]:
    """PyTorch's DTensor class, or None in a build without ``torch.distributed``."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (Megatron-FSDP's parameters and state are)."""
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a DTensor's local shard (the tensor that holds its memory)."""
    if not _is_dtensor(tensor):
        return tensor
    dtensor: Any = tensor
    local: torch.Tensor = dtensor.to_local()
    return local


def _storage_ptr(tensor: torch.Tensor) -> int:
    """Return the address of ``tensor``'s storage, a DTensor's local one (0 when empty)."""
    return int(_local_tensor(tensor).untyped_storage().data_ptr())


def _dtensor_decline_reason(tensor: Any, like: torch.Tensor) -> Optional[str]:
    """Accept a DTensor laid out as the DTensor parameter ``like`` is: the same device mesh,
    placements, global shape and stride (what TE's loader gives every state DTensor)."""
    if not _is_dtensor(tensor):
        return f"is a {type(tensor).__name__}, the parameter a DTensor"
    for attribute in ("device_mesh", "placements"):
        if getattr(tensor, attribute) != getattr(like, attribute):
            return f"has another {attribute} than the parameter"
    if tensor.shape != like.shape or tensor.stride() != like.stride():
        return (
            f"has global shape {tuple(tensor.shape)} and stride {tensor.stride()}, the "
            f"parameter {tuple(like.shape)} and {like.stride()}"
        )
    return None


def _plain_tensor_decline_reason(
    tensor: Any, dtype: torch.dtype, like: torch.Tensor
) -> Optional[str]:
    """Accept a dense, contiguous ``dtype`` tensor placed and shaped like ``like``; for a
    DTensor parameter, a DTensor laid out like it whose local shard is such a tensor."""
    if _is_dtensor(like):
        reason = _dtensor_decline_reason(tensor, like)
        if reason is not None:
            return reason
        tensor, like = _local_tensor(tensor), _local_tensor(like)
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


def _paired_entries_decline_reason(
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    param_decline_reason: _ParamRule,
    entry_decline_reason: Optional[_EntryRule] = None,
) -> Optional[str]:
    """One pass over the parameters: groups, each parameter, its one entry, the entry's rule."""
    reason = _param_groups_decline_reason(optimizer, state_dict)
    if reason is not None:
        return reason
    incoming_state = state_dict["state"]
    incoming_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    entries = 0
    for index, (state_id, param) in enumerate(zip(incoming_ids, _optimizer_params(optimizer))):
        reason = param_decline_reason(param)
        if reason is None and state_id not in incoming_state:
            if _local_tensor(param).numel() == 0:
                continue  # an empty shard has no state (Megatron-FSDP creates none for it)
            reason = "has no incoming state"
        if reason is None and entry_decline_reason is not None:
            reason = entry_decline_reason(param, incoming_state[state_id])
        if reason is not None:
            return f"parameter {index}: {reason}"
        entries += 1
    if len(incoming_state) != entries:
        return "the incoming state does not hold exactly one entry per parameter"
    return None


def one_entry_per_param_decline_reason(
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    param_decline_reason: _ParamRule,
) -> Optional[str]:
    """Require matching param groups, accepted parameters and one state entry per parameter
    (none for a parameter whose local shard is empty, as Megatron-FSDP leaves it).

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer.
        state_dict (Mapping[str, Any]): the incoming state dict.
        param_decline_reason (Callable): the adopter's rule for one parameter.

    Returns:
        Optional[str]: None if every parameter is accepted and has exactly one incoming state
        entry, otherwise the first problem.
    """
    return _paired_entries_decline_reason(optimizer, state_dict, param_decline_reason)


def incoming_state_decline_reason(
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    param_decline_reason: _ParamRule,
    expected_state: Callable[[torch.Tensor], ExpectedState],
) -> Optional[str]:
    """Check groups, parameters and every incoming state tensor for by-reference adoption.

    In one pass: :func:`one_entry_per_param_decline_reason`, and for each entry
    :func:`state_entry_decline_reason` with the keys and dtypes of ``expected_state(param)``,
    no two state tensors nor a state tensor and a parameter sharing a storage.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer.
        state_dict (Mapping[str, Any]): the incoming state dict.
        param_decline_reason (Callable): the adopter's rule for one parameter.
        expected_state (Callable): the keys and dtypes accepted for one parameter.

    Returns:
        Optional[str]: None if everything can be adopted, otherwise the first problem.
    """
    seen_storages: Set[int] = {
        _storage_ptr(p) for p in _optimizer_params(optimizer) if _local_tensor(p).nbytes > 0
    }
    return _paired_entries_decline_reason(
        optimizer,
        state_dict,
        param_decline_reason,
        lambda param, entry: state_entry_decline_reason(
            param, entry, expected_state(param), seen_storages
        ),
    )


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
        if _local_tensor(entry[key]).nbytes > 0:
            storage = _storage_ptr(entry[key])
            if storage in seen_storages:
                return f"{key} shares storage with a parameter or another state tensor"
            seen_storages.add(storage)
    return None


def _same_value(installed: Any, given: Any) -> bool:
    """Whether an installed hyper-parameter equals the given one (PyTorch's loader installs deep
    copies); tensors by their bits, objects without their own ``==`` by their type only."""
    if installed is given:
        return True
    if isinstance(installed, torch.Tensor) or isinstance(given, torch.Tensor):
        return (
            isinstance(installed, torch.Tensor)
            and isinstance(given, torch.Tensor)
            and installed.dtype == given.dtype
            and installed.shape == given.shape
            and bool(torch.equal(installed.cpu(), given.cpu()))
        )
    if type(installed) is not type(given):
        return False
    if getattr(type(given), "__eq__") is getattr(object, "__eq__"):
        return True  # a deep copy of an object without its own == is not ==, but no mistake
    try:
        return bool(installed == given)
    except Exception:  # a value without a usable == is not the given one
        return False


def installed_state_decline_reason(
    optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any], params: List[List[Any]]
) -> Optional[str]:
    """Check an install against what every loader gets right (the loader runs it after each
    ``adopt``); None if nothing is wrong.

    Whatever else it does, a loader (PyTorch's, TE's) keeps the optimizer's parameters
    (``params``, group by group) in its groups, installs every hyper-parameter of the state
    dict's groups (TE keeps its ``step`` there), and gives state to exactly the parameters the
    state dict has state for, paired by position as PyTorch pairs them, with no key the
    incoming entry lacks and every key it has a value for (TE's loader skips None values).

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer after the install.
        state_dict (Mapping[str, Any]): the installed state dict, as it was before the install.
        params (List[List[Any]]): the optimizer's parameters before the install, per group.

    Returns:
        Optional[str]: None if the install kept these rules, otherwise the first it broke.
    """
    groups, state = optimizer.param_groups, optimizer.state
    if [len(group["params"]) for group in groups] != [len(p) for p in params] or any(
        a is not b for group, p in zip(groups, params) for a, b in zip(group["params"], p)
    ):
        return "the param groups do not hold the optimizer's parameters"
    incoming, incoming_groups = state_dict["state"], state_dict["param_groups"]
    if [len(group["params"]) for group in incoming_groups] != [len(p) for p in params]:
        return "the state dict's param groups do not match the optimizer's"
    for index, (group, given_group) in enumerate(zip(groups, incoming_groups)):
        for key, value in given_group.items():
            if key != "params" and not (key in group and _same_value(group[key], value)):
                return f"param group {index} does not have the state dict's {key}"
    flat = [param for p in params for param in p]
    known = {id(param) for param in flat}
    if any(isinstance(key, torch.Tensor) and id(key) not in known for key in state):
        return "there is state for a tensor that is no parameter of the optimizer"
    ids = (state_id for group in incoming_groups for state_id in group["params"])
    for index, (state_id, param) in enumerate(zip(ids, flat)):
        entry, given = state.get(param), incoming.get(state_id)
        if state_id not in incoming:
            if entry:
                return f"parameter {index} has state, the state dict none"
        elif not isinstance(entry, Mapping):
            return f"parameter {index} has no state"
        elif isinstance(given, Mapping) and not (
            {key for key, value in given.items() if value is not None} <= set(entry) <= set(given)
        ):
            return (
                f"the state of parameter {index} has keys {sorted(map(str, entry))}, the state "
                f"dict {sorted(map(str, given))}"
            )
    return None


def _is_held_tensor(exported: Any, held: torch.Tensor) -> Optional[str]:
    """None if ``exported`` is ``held`` or an exact alias of it, else what differs."""
    if exported is held:
        return None
    if type(exported) is not type(held) or type(held) is not torch.Tensor:
        return f"is a {type(exported).__name__}, not the held {type(held).__name__}"
    for attribute in ("dtype", "shape", "device"):
        if getattr(exported, attribute) != getattr(held, attribute):
            return (
                f"has {attribute} {getattr(exported, attribute)}, the held state "
                f"{getattr(held, attribute)}"
            )
    if exported.nbytes > 0 and (
        _storage_ptr(exported),
        exported.storage_offset(),
        exported.stride(),
    ) != (_storage_ptr(held), held.storage_offset(), held.stride()):
        return "is not the held tensor (a copy, or another parameter's state)"
    return None


def exported_state_dict_decline_reason(
    optimizer: torch.optim.Optimizer, exported: Any
) -> Optional[str]:
    """Check that an export is the optimizer's state as it holds it.

    It must be what ``torch.optim.Optimizer.state_dict`` packs, without running it: exactly
    the keys ``state`` and ``param_groups``; the optimizer's groups, in order, each with the
    same hyper-parameters and the parameter ids PyTorch assigns; state for exactly the
    parameters that hold state, each with exactly the held keys, every tensor the held tensor
    itself (same dtype, shape, device and storage; so neither a copy nor another parameter's
    state), every other value equal to the held one. So an empty, partial or permuted export
    is refused.

    Args:
        optimizer (torch.optim.Optimizer): the inner optimizer.
        exported (Any): what an exporter returned.

    Returns:
        Optional[str]: None if the export matches, otherwise the first difference.
    """
    if not isinstance(exported, dict) or set(exported) != {"state", "param_groups"}:
        keys = sorted(map(str, exported)) if isinstance(exported, Mapping) else None
        return f"it is not a dict with exactly 'state' and 'param_groups' (got {keys})"
    groups, state = exported["param_groups"], exported["state"]
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        return "'param_groups' is not a list or 'state' is not a mapping"
    if len(groups) != len(optimizer.param_groups):
        return f"it has {len(groups)} param groups, the optimizer {len(optimizer.param_groups)}"
    ids: Dict[int, int] = {}  # numbered as torch.optim.Optimizer.state_dict numbers them
    for index, (group, held_group) in enumerate(zip(groups, optimizer.param_groups)):
        start = sum(len(g["params"]) for g in optimizer.param_groups[:index])
        for position, param in enumerate(held_group["params"], start):
            ids.setdefault(id(param), position)
        expected_ids = [ids[id(p)] for p in held_group["params"]]
        if not isinstance(group, Mapping) or group.get("params") != expected_ids:
            return f"param group {index} does not list the parameter ids {expected_ids}"
        if set(group) != set(held_group):
            return f"param group {index} has keys {sorted(group)}, the optimizer's {sorted(held_group)}"
        for key, value in held_group.items():
            if key != "params" and not _same_value(group[key], value):
                return f"param group {index} has {key}={group[key]!r}, the optimizer {value!r}"
    held_state = {
        ids[id(param)]: entry
        for param, entry in optimizer.state.items()
        if isinstance(param, torch.Tensor) and id(param) in ids
    }
    if set(state) != set(held_state):
        return (
            f"it has state for {len(state)} ids ({sorted(map(str, state))[:8]}), the optimizer "
            f"holds state for ids {sorted(held_state)[:8]} ({len(held_state)})"
        )
    for state_id, held in held_state.items():
        entry = state[state_id]
        if not isinstance(entry, Mapping) or set(entry) != set(held):
            keys = sorted(map(str, entry)) if isinstance(entry, Mapping) else entry
            return f"the state of parameter {state_id} has keys {keys}, the held {sorted(held)}"
        for key, value in held.items():
            if isinstance(value, torch.Tensor):
                problem = _is_held_tensor(entry[key], value)
            else:
                problem = None if _same_value(entry[key], value) else f"is {entry[key]!r}"
            if problem is not None:
                return f"{key} of parameter {state_id} {problem}"
    return None
