"""Default adopter: Transformer Engine's FusedAdam with FP32 Adam moments.

``FusedAdam.load_state_dict`` first runs PyTorch's loader, then, for every parameter,
allocates a new state tensor and copies the incoming one into it. While that loop runs the
caller still holds the incoming tensors, so two copies of the moments coexist: a transient
8 bytes per parameter. When the moments are FP32 and no TE master weights are kept, the
incoming tensors already have the exact dtype, device and shape TE would allocate, and
TE's ``step`` uses FP32 state tensors as they are. This adopter then runs only PyTorch's
loader, which installs them by reference, and skips the copy. Any other configuration is
declined and keeps TE's own loader.
"""

import sys
from itertools import chain
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Set, Tuple

import torch

from .adopter import StateAdoptionContext

TE_FUSED_ADAM_MODULE = "transformer_engine.pytorch.optimizers.fused_adam"
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")

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

_ParamAndState = Tuple[int, torch.Tensor, Any]


def _loaded_te_fused_adam_class() -> Optional[type]:
    """Return TE's FusedAdam if TE has already been imported, without importing it."""
    module = sys.modules.get(TE_FUSED_ADAM_MODULE)
    fused_adam = getattr(module, "FusedAdam", None)
    return fused_adam if isinstance(fused_adam, type) else None


def _storage_ptr(tensor: torch.Tensor) -> int:
    """Return the address of ``tensor``'s storage (0 for an empty storage)."""
    return int(tensor.untyped_storage().data_ptr())


class TEFusedAdamFP32StateAdopter:
    """Installs FP32 Adam moments into TE FusedAdam by reference.

    Args:
        fused_adam_class (type, optional): the FusedAdam class to recognise. Defaults to
            Transformer Engine's, looked up among the imported modules at check time (TE is
            never imported by this adopter). Tests on machines without TE pass a stand-in.
        param_device_type (str): device type every inner parameter and moment must be on.
    """

    name = "te_fused_adam_fp32"

    def __init__(
        self, fused_adam_class: Optional[type] = None, param_device_type: str = "cuda"
    ) -> None:
        self._fused_adam_class = fused_adam_class
        self._param_device_type = param_device_type

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        """Return None if every eligibility rule holds, else the first rule that fails.

        Args:
            context (StateAdoptionContext): the optimizer and the incoming state.

        Returns:
            Optional[str]: None to accept, otherwise why the state is left to TE's loader.
        """
        checks: Sequence[Callable[[StateAdoptionContext], Optional[str]]] = (
            self._owner_decline_reason,
            self._optimizer_class_decline_reason,
            self._optimizer_settings_decline_reason,
            self._incoming_state_decline_reason,
        )
        for check in checks:
            reason = check(context)
            if reason is not None:
                return reason
        return None

    def adopt(self, context: StateAdoptionContext) -> int:
        """Run PyTorch's loader (FusedAdam's first step) and skip TE's re-allocation.

        Args:
            context (StateAdoptionContext): a context this adopter accepted.

        Returns:
            int: bytes of moments installed by reference, which TE would have re-allocated.
        """
        optimizer = context.optimizer
        pairs = list(_param_state_pairs(optimizer, context.state_dict))
        # PyTorch's loader validates the groups, installs their hyper-parameters (TE's
        # per-group 'step' included), runs post-hooks (pre-hooks were declined) and keeps
        # tensors whose dtype and device already match the parameter's, which were checked.
        torch.optim.Optimizer.load_state_dict(optimizer, dict(context.state_dict))
        adopted_bytes = 0
        for index, param, incoming in pairs:
            installed = optimizer.state[param]
            for key in MOMENT_KEYS:
                if installed.get(key) is not incoming[key]:
                    raise RuntimeError(
                        f"PyTorch's loader did not keep {key} of parameter {index} by reference"
                    )
                adopted_bytes += incoming[key].nbytes
        return adopted_bytes

    def _owner_decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        """Decline owners whose mode keeps a different state layout or loader."""
        if context.is_stub_optimizer:
            return "the DistributedOptimizer is a stub"
        if context.config is None or context.ddp_config is None:
            return "the owner's OptimizerConfig or DistributedDataParallelConfig is unknown"
        owner_flags = (
            (context.ddp_config, "use_megatron_fsdp", "Megatron-FSDP manages the state"),
            (context.config, "optimizer_cpu_offload", "the optimizer is CPU-offloaded"),
            (
                context.config,
                "use_precision_aware_optimizer",
                "the optimizer is precision-aware",
            ),
        )
        for config, flag, meaning in owner_flags:
            if not hasattr(config, flag):
                return f"{type(config).__name__} has no '{flag}'"
            if getattr(config, flag):
                return f"{flag} is set: {meaning}"
        return None

    def _optimizer_class_decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        """Accept TE FusedAdam and subclasses that keep TE's state handling."""
        fused_adam = self._fused_adam_class or _loaded_te_fused_adam_class()
        if fused_adam is None:
            return "Transformer Engine's FusedAdam is not loaded"
        optimizer_class = type(context.optimizer)
        if not issubclass(optimizer_class, fused_adam):
            return f"the inner optimizer is {optimizer_class.__qualname__}, not FusedAdam"
        for method in _TE_STATE_METHODS:
            if getattr(optimizer_class, method, None) is not getattr(fused_adam, method, None):
                return f"{optimizer_class.__qualname__} overrides FusedAdam.{method}"
        pre_hooks = getattr(context.optimizer, "_optimizer_load_state_dict_pre_hooks", None)
        if pre_hooks is None:
            return "the optimizer's load_state_dict pre-hooks cannot be inspected"
        if len(pre_hooks) > 0:
            return "a load_state_dict pre-hook is registered and may rewrite the state"
        return None

    def _optimizer_settings_decline_reason(
        self, context: StateAdoptionContext
    ) -> Optional[str]:
        """Accept only FP32 moments without TE master weights or param remainders."""
        optimizer = context.optimizer
        for flag in ("master_weights", "store_param_remainders"):
            if not hasattr(optimizer, flag):
                return f"FusedAdam has no '{flag}' attribute"
            if getattr(optimizer, flag):
                return f"FusedAdam.{flag} is set"
        dtypes = getattr(optimizer, "name_to_dtype_map", None)
        if not isinstance(dtypes, Mapping):
            return "FusedAdam has no 'name_to_dtype_map'"
        for key in MOMENT_KEYS:
            if dtypes.get(key) is not torch.float32:
                return f"FusedAdam keeps {key} in {dtypes.get(key)}, not torch.float32"
        return None

    def _incoming_state_decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        """Check the param groups, every parameter and every incoming moment."""
        optimizer = context.optimizer
        reason = _param_groups_decline_reason(optimizer, context.state_dict)
        if reason is not None:
            return reason
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, param in enumerate(params):
            reason = self._param_decline_reason(param)
            if reason is not None:
                return f"parameter {index}: {reason}"
        pairs = list(_param_state_pairs(optimizer, context.state_dict))
        if len(context.state_dict["state"]) != len(pairs) or len(pairs) != len(params):
            return "the incoming state does not hold exactly one entry per parameter"
        seen_storages = {_storage_ptr(p) for p in params if p.nbytes > 0}
        for index, param, incoming in pairs:
            reason = _moments_decline_reason(param, incoming, seen_storages)
            if reason is not None:
                return f"parameter {index}: {reason}"
        return None

    def _param_decline_reason(self, param: torch.Tensor) -> Optional[str]:
        """Accept plain FP32 parameters on the expected device type."""
        if type(param) not in (torch.Tensor, torch.nn.Parameter):
            return f"is a {type(param).__name__}, not a plain tensor"
        if param.dtype != torch.float32:
            return f"is {param.dtype}, not torch.float32"
        if param.device.type != self._param_device_type:
            return f"is on {param.device}, not on {self._param_device_type}"
        return None


def _param_groups_decline_reason(
    optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> Optional[str]:
    """Perform PyTorch's param-group validation without raising."""
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


def _param_state_pairs(
    optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> Iterator[_ParamAndState]:
    """Yield (position, parameter, incoming state) as PyTorch's loader pairs them."""
    incoming_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    incoming_state = state_dict["state"]
    for index, (state_id, param) in enumerate(zip(incoming_ids, params)):
        if state_id in incoming_state:
            yield index, param, incoming_state[state_id]


def _moments_decline_reason(
    param: torch.Tensor, incoming: Any, seen_storages: Set[int]
) -> Optional[str]:
    """Accept exactly {exp_avg, exp_avg_sq}, each a tensor TE itself would have allocated.

    ``seen_storages`` holds the storages of all parameters and of the moments checked so
    far; the moments' own storages are added to it.
    """
    if not isinstance(incoming, Mapping):
        return f"the incoming state is a {type(incoming).__name__}, not a dict"
    if set(incoming.keys()) != set(MOMENT_KEYS):
        return f"the incoming state has keys {sorted(map(str, incoming))}, not {list(MOMENT_KEYS)}"
    for key in MOMENT_KEYS:
        reason = _moment_decline_reason(param, incoming[key])
        if reason is not None:
            return f"{key} {reason}"
        if incoming[key].nbytes > 0:
            storage = _storage_ptr(incoming[key])
            if storage in seen_storages:
                return f"{key} shares storage with a parameter or another state tensor"
            seen_storages.add(storage)
    return None


def _moment_decline_reason(param: torch.Tensor, moment: Any) -> Optional[str]:
    """Accept a dense, contiguous FP32 tensor shaped and placed like ``param``."""
    if type(moment) is not torch.Tensor:
        return f"is a {type(moment).__name__}, not a plain torch.Tensor"
    if moment.is_quantized:
        return "is quantized"
    if moment.layout != torch.strided:
        return f"has layout {moment.layout}, not torch.strided"
    if moment.dtype != torch.float32:
        return f"is {moment.dtype}, not torch.float32"
    if moment.device != param.device:
        return f"is on {moment.device}, the parameter on {param.device}"
    if moment.shape != param.shape:
        return f"has shape {tuple(moment.shape)}, the parameter {tuple(param.shape)}"
    if not moment.is_contiguous():
        return "is not contiguous"
    if moment.requires_grad:
        return "requires grad"
    return None
