# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""Side-effect-free checks of incoming, installed, exported, initialized and read-target state:
None if the rule holds, else a reason. Tensors are compared by the bytes they cover in their
storage, so views, aliases and overlaps are found whoever holds them."""

import bisect
from itertools import chain
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

from .adopter import AdoptionContext

ExpectedState = Mapping[str, torch.dtype]
"""State keys of one parameter, each with the dtype it must have."""

_PLAIN_CAST_DTYPES = (torch.bfloat16, torch.float32, torch.int16)
_MISSING = object()


def params_of(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    """Every parameter of ``optimizer``, group by group (PyTorch's state-dict order)."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def tensors_of(state: object) -> List[torch.Tensor]:
    """The tensors of a list of tensors or of a ``{key: {name: value}}`` state mapping."""
    if isinstance(state, Mapping):
        entries = [e for e in state.values() if isinstance(e, Mapping)]
        return [v for e in entries for v in e.values() if isinstance(v, torch.Tensor)]
    return [t for t in state if isinstance(t, torch.Tensor)] if isinstance(state, list) else []


def params_problem(
    optimizer: torch.optim.Optimizer, rule: Callable[[torch.Tensor], Optional[str]]
) -> Optional[str]:
    """The first parameter ``rule`` declines, named by its position; None if none."""
    reasons = ((index, rule(param)) for index, param in enumerate(params_of(optimizer)))
    return next((f"parameter {index}: {reason}" for index, reason in reasons if reason), None)


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor (Megatron-FSDP's parameters and state are)."""
    return isinstance(value, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor that holds its memory), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def extent(tensor: torch.Tensor) -> Optional[Tuple[int, int, int]]:
    """(storage address, first byte, end byte) of the memory ``tensor`` covers; None if none."""
    shard = local(tensor)
    if shard.layout != torch.strided or shard.numel() == 0 or shard.device.type == "meta":
        return None
    span = 1 + sum((size - 1) * abs(step) for size, step in zip(shard.shape, shard.stride()))
    start = int(shard.storage_offset()) * shard.element_size()
    return (shard.untyped_storage().data_ptr(), start, start + int(span) * shard.element_size())


class Extents:
    """Labelled byte ranges of tensors, to find the tensors a new one overlaps."""

    def __init__(self) -> None:
        self._ranges: Dict[int, List[Tuple[int, int, str]]] = {}

    def overlap(self, tensor: torch.Tensor, allowed: Optional[str] = None) -> Optional[str]:
        """The label of a range ``tensor`` overlaps, other than an equal one named ``allowed``."""
        return self._overlap(extent(tensor), allowed)

    def _overlap(
        self, place: Optional[Tuple[int, int, int]], allowed: Optional[str]
    ) -> Optional[str]:
        if place is None:
            return None
        storage, start, end = place
        ranges = self._ranges.get(storage, [])
        for other_start, other_end, label in reversed(ranges[: bisect.bisect_left(ranges, (end,))]):
            if other_end <= start:
                break  # ranges are disjoint (or equal), so no earlier one reaches start
            if not (label == allowed and (other_start, other_end) == place[1:]):
                return label
        return None

    def add(self, tensor: torch.Tensor, label: str, allowed: Optional[str] = None) -> Optional[str]:
        """Add ``tensor``'s range unless it overlaps one (see :meth:`overlap`): then return that
        one's label (so the ranges stay disjoint, or equal where allowed)."""
        place = extent(tensor)
        overlapped = self._overlap(place, allowed)
        if place is not None and overlapped is None:
            bisect.insort(self._ranges.setdefault(place[0], []), (place[1], place[2], label))
        return overlapped


def owner_problem(context: AdoptionContext, precision_aware: bool) -> Optional[str]:
    """Decline stub and CPU-offloaded owners, and the other precision mode than the adopter's."""
    config = context.config
    if context.is_stub_optimizer:
        return "the owner is a stub optimizer"
    if config is None:
        return "the owner's OptimizerConfig is unknown"
    flags = {"optimizer_cpu_offload": False, "use_precision_aware_optimizer": precision_aware}
    for flag, required in flags.items():
        if not hasattr(config, flag):
            return f"{type(config).__name__} has no '{flag}'"
        if bool(getattr(config, flag)) != required:
            return f"{flag} is {'not ' if required else ''}set"
    return None


def tensor_problem(value: object, dtype: torch.dtype, like: torch.Tensor) -> Optional[str]:
    """Accept a dense, contiguous, plain ``dtype`` tensor on ``like``'s device and of its shape,
    not requiring grad; for a DTensor ``like``, a DTensor of its layout whose shard is one.
    """
    if is_dtensor(like):
        if not isinstance(value, torch.Tensor) or not is_dtensor(value):
            return f"is a {type(value).__name__}, the parameter a DTensor"
        for attribute in ("device_mesh", "placements", "shape"):
            if getattr(value, attribute) != getattr(like, attribute):
                return f"has another {attribute} than the parameter"
        if value.stride() != like.stride():
            return "has another stride than the parameter"
        value, like = local(value), local(like)
    if type(value) is not torch.Tensor:
        return f"is a {type(value).__name__}, not a plain torch.Tensor"
    if value.is_quantized or value.layout != torch.strided:
        return f"is quantized or has layout {value.layout}"
    if value.is_neg() or value.is_conj():
        return "is a negated or conjugated view"
    if value.dtype != dtype:
        return f"is {value.dtype}, not {dtype}"
    if value.device != like.device:
        return f"is on {value.device}, the parameter on {like.device}"
    if value.shape != like.shape:
        return f"has shape {tuple(value.shape)}, the parameter {tuple(like.shape)}"
    if not value.is_contiguous():
        return "is not contiguous"
    if value.requires_grad:
        return "requires grad"
    return None


def param_groups_problem(
    optimizer: torch.optim.Optimizer, state_dict: Optional[Mapping[str, Any]]
) -> Optional[str]:
    """PyTorch's validation of a state dict's groups (count and sizes), without raising."""
    state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        return "the state dict lacks a 'state' mapping or a 'param_groups' list"
    if len(groups) != len(optimizer.param_groups):
        count = len(optimizer.param_groups)
        return f"the state dict has {len(groups)} param groups, the optimizer {count}"
    for index, (given, group) in enumerate(zip(groups, optimizer.param_groups)):
        if not isinstance(given, Mapping) or not isinstance(given.get("params"), list):
            return f"param group {index} of the state dict has no 'params' list"
        if len(given["params"]) != len(group["params"]):
            counts = f"{len(given['params'])} params in the state dict, {len(group['params'])}"
            return f"param group {index} has {counts} in the optimizer"
    return None


def paired_state(
    optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> Iterator[Tuple[int, torch.Tensor, Any]]:
    """Yield (position, parameter, incoming entry or a marker for none) as PyTorch pairs them."""
    ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
    for index, (state_id, param) in enumerate(zip(ids, params_of(optimizer))):
        yield index, param, state_dict["state"].get(state_id, _MISSING)


def held_state_dict(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """PyTorch's state dict of ``optimizer`` (no hooks run): its groups, and the held entries."""
    ids = {id(param): index for index, param in enumerate(params_of(optimizer))}
    groups = [
        {**group, "params": [ids[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    state = {ids[id(p)]: dict(entry) for p, entry in optimizer.state.items() if id(p) in ids}
    return {"state": state, "param_groups": groups}


def held_extents(optimizer: torch.optim.Optimizer) -> Extents:
    """The parameters' and the held state tensors' ranges, labelled by parameter and key."""
    extents = Extents()
    for index, param in enumerate(params_of(optimizer)):
        extents.add(param, f"parameter {index}")
        entry = optimizer.state.get(param)
        for key, value in entry.items() if isinstance(entry, Mapping) else ():
            if isinstance(value, torch.Tensor):
                extents.add(value, f"held {key} of parameter {index}")
    return extents


def incoming_state_problem(
    context: AdoptionContext,
    param_problem: Callable[[torch.Tensor], Optional[str]],
    expected: Callable[[torch.Tensor], ExpectedState],
) -> Optional[str]:
    """Check a load's state dict for installing by reference: PyTorch's group validation; every
    parameter accepted by ``param_problem`` with one entry (none for an empty local shard) of
    exactly the keys of ``expected(param)``, each tensor meeting :func:`tensor_problem`, none
    overlapping another or a parameter; each held already unless the call site owns the dict.
    """
    optimizer, state_dict = context.optimizer, context.state_dict
    reason = param_groups_problem(optimizer, state_dict)
    if reason is not None or state_dict is None:
        return reason
    extents, entries = Extents(), 0
    for index, param in enumerate(params_of(optimizer)):
        extents.add(param, f"parameter {index}")
    for index, param, entry in paired_state(optimizer, state_dict):
        reason = param_problem(param)
        if reason is None and entry is _MISSING:
            if local(param).numel() == 0:
                continue  # an empty shard has no state (Megatron-FSDP creates none)
            reason = "has no incoming state"
        if reason is None:
            entries += 1
            reason = _entry_problem(context, param, entry, expected(param), extents)
        if reason is not None:
            return f"parameter {index}: {reason}"
    if len(state_dict["state"]) != entries:
        return "the incoming state does not hold exactly one entry per parameter"
    return None


def _entry_problem(
    context: AdoptionContext,
    param: torch.Tensor,
    entry: object,
    expected: ExpectedState,
    extents: Extents,
) -> Optional[str]:
    """One parameter's incoming entry: keys, tensors, overlaps and whom the tensors belong to."""
    if not isinstance(entry, Mapping) or set(entry) != set(expected):
        keys = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
        return f"the incoming state has keys {keys}, not {sorted(expected)}"
    held = context.optimizer.state.get(param, {})
    for key, dtype in expected.items():
        value = entry[key]
        reason = tensor_problem(value, dtype, param)
        if reason is not None:
            return f"incoming {key} {reason}"
        overlapped = extents.add(value, f"incoming {key}")
        if overlapped is not None:
            return f"incoming {key} overlaps {overlapped}"
        if not context.owns_state_dict and not same_memory(value, held.get(key)):
            return (
                f"incoming {key} is the caller's tensor, not the held one: the caller may keep it"
            )
    return None


def same_memory(tensor: object, other: object) -> bool:
    """Whether two tensors are the same elements of the same memory (a tensor or an alias; two
    empty tensors of one layout share nothing to tell apart)."""
    if not (isinstance(tensor, torch.Tensor) and isinstance(other, torch.Tensor)):
        return False
    a, b = local(tensor), local(other)
    layout = [(t.dtype, t.shape, t.stride(), t.device) for t in (a, b)]
    return tensor is other or (layout[0] == layout[1] and extent(a) == extent(b))


def same_value(installed: object, given: object) -> bool:
    """Whether a hyper-parameter equals the given one: tensors bit for bit, objects without an
    ``==`` of their own by type (PyTorch's loader installs deep copies)."""
    if installed is given:
        return True
    if isinstance(installed, torch.Tensor) and isinstance(given, torch.Tensor):
        same_layout = (installed.dtype, installed.shape) == (given.dtype, given.shape)
        return same_layout and bool(torch.equal(installed.cpu(), given.cpu()))
    try:  # a deep copy of an object without an == of its own is the same value
        own_eq = getattr(type(given), "__eq__") is not getattr(object, "__eq__")
        return type(installed) is type(given) and (not own_eq or bool(installed == given))
    except Exception:  # a value without a usable == is not the given one
        return False


def installed_state_problem(
    optimizer: torch.optim.Optimizer, given: Mapping[str, Any], params: List[List[torch.Tensor]]
) -> Optional[str]:
    """Check an install: the parameters stay in their groups (``params``, as before the load),
    which get the state dict's hyper-parameters; exactly the parameters the state dict has state
    for get state, with its keys (None values may be left out); each tensor is the incoming one
    itself (same memory, dtype, shape and device), each other value equal to the incoming one."""
    groups, flat = optimizer.param_groups, [param for group in params for param in group]
    if [len(g["params"]) for g in groups] != [len(p) for p in params] or any(
        a is not b for g, p in zip(groups, params) for a, b in zip(g["params"], p)
    ):
        return "the param groups do not hold the optimizer's parameters"
    for index, (group, given_group) in enumerate(zip(groups, given["param_groups"])):
        for key, value in given_group.items():
            if key != "params" and not (key in group and same_value(group[key], value)):
                return f"param group {index} does not have the state dict's {key}"
    known = {id(param) for param in flat}
    if any(id(key) not in known for key in optimizer.state):
        return "there is state for something that is no parameter of the optimizer"
    for index, param, source in paired_state(optimizer, given):
        entry = optimizer.state.get(param)
        if source is _MISSING or source is None:
            if entry:
                return f"parameter {index} has state, the state dict none"
            continue
        if not isinstance(entry, Mapping) or not (
            {k for k, v in source.items() if v is not None} <= set(entry) <= set(source)
        ):
            return f"the state of parameter {index} does not have the state dict's keys"
        for key, value in entry.items():
            incoming = source[key]
            if isinstance(incoming, torch.Tensor):
                if not same_memory(value, incoming):
                    return f"{key} of parameter {index} is not the incoming tensor itself"
            elif not (same_value(value, incoming) or _loaded_number(value, incoming)):
                return f"{key} of parameter {index} is not the incoming value"
    return None


def _loaded_number(value: object, incoming: object) -> bool:
    """Whether ``value`` is PyTorch's loader's CPU tensor of the number ``incoming`` (Adam turns
    an old checkpoint's float ``step`` into one)."""
    if not isinstance(value, torch.Tensor) or not isinstance(incoming, (int, float)):
        return False
    return value.numel() == 1 and value.device.type == "cpu" and value.item() == incoming


def exported_state_problem(optimizer: torch.optim.Optimizer, exported: object) -> Optional[str]:
    """Check that an export is PyTorch's state dict of the optimizer as it holds its state
    (:func:`held_state_dict`): the same keys and ids, each tensor the held one itself.
    """
    return mismatch(exported, held_state_dict(optimizer), "the export")


def mismatch(value: Any, held: Any, where: str) -> Optional[str]:
    """Where ``value`` differs from ``held``: containers by keys/length, tensors by memory."""
    if isinstance(held, torch.Tensor):
        return None if same_memory(value, held) else f"{where} is not the held tensor"
    if isinstance(held, (dict, list)):
        if type(value) is not type(held) or len(value) != len(held):
            return f"{where} is not a {type(held).__name__} of {len(held)} items as held"
        keys = range(len(held)) if isinstance(held, list) else held
        if isinstance(held, dict) and set(value) != set(held):
            return f"{where} has the keys {sorted(map(str, value))}, not the held ones"
        return next(
            filter(None, (mismatch(value[k], held[k], f"{where}[{k!r}]") for k in keys)), None
        )
    return None if same_value(value, held) else f"{where} is {value!r}, not the held {held!r}"


def initialized_state_problem(
    optimizer: torch.optim.Optimizer, params: List[torch.Tensor]
) -> Optional[str]:
    """State for exactly the parameters (``params``) with a non-empty local shard."""
    known = {id(param) for param in params}
    if any(id(key) not in known for key in optimizer.state):
        return "there is state for something that is no parameter of the optimizer"
    for index, param in enumerate(params):
        entry = optimizer.state.get(param)
        if local(param).numel() > 0 and not (
            isinstance(entry, Mapping) and any(isinstance(v, torch.Tensor) for v in entry.values())
        ):
            return f"parameter {index} has no state"
    return None


def read_target_problem(
    optimizer: torch.optim.Optimizer,
    param: torch.Tensor,
    name: str,
    target: object,
    extents: Extents,
    label: str,
) -> Optional[str]:
    """Check one read target and add it to ``extents``: the held tensor of ``name`` itself where
    reading into it is a plain cast (BF16, FP32, int16 remainders), or new memory of the held
    shape and device in ``get_unscaled_state``'s dtype (int16 for remainders, else FP32); it
    overlaps nothing else (``label``: ``"<name> of parameter <index>"``)."""
    if not isinstance(target, torch.Tensor):
        return f"the target is a {type(target).__name__}, not a tensor"
    entry = optimizer.state.get(param)
    held = entry.get(name) if isinstance(entry, Mapping) else None
    if not isinstance(held, torch.Tensor):
        return f"the optimizer holds no {name!r} for this parameter"
    held = local(held)
    if same_memory(target, held):
        if held.dtype not in _PLAIN_CAST_DTYPES:
            return f"the held {name!r} is {held.dtype}, which TE scales: it needs an FP32 target"
        overlapped = extents.add(target, f"target {label}", allowed=f"held {label}")
    else:
        dtype = torch.int16 if held.dtype == torch.int16 else torch.float32
        reason = tensor_problem(target, dtype, held)
        if reason is not None:
            return f"the target {reason}"
        overlapped = extents.add(target, f"target {label}")
    return None if overlapped is None else f"the target overlaps {overlapped}"
