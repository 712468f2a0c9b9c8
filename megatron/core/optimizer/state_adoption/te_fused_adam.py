# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""The adopters of Transformer Engine FusedAdam's state, whose loader (TE 1.13 to 2.20,
docs/te-releases.md) runs PyTorch's, then allocates every state anew and copies the incoming one
in while the caller still holds it. Each declines what it cannot prove equal to TE's result:
:class:`TEFusedAdamFP32StateAdopter` (registered) for FP32 moments without master weights,
:class:`TEFusedAdamPrecisionAwareStateAdopter` (opt-in) for BF16 moments with master weights.
"""

import sys
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Tuple, cast

import torch
from packaging.version import InvalidVersion, Version
from torch.distributed.tensor import DTensor

from megatron.core.utils import get_te_version

from . import checks
from .adopter import AdoptionContext, StateAdopter
from .allocation import packed_zeros

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
# FusedAdam methods that allocate, scale or expose state: overriding one may rely on TE's loader.
_STATE_METHODS = tuple(
    "load_state_dict state_dict initialize_state _initialize_state set_scaled_state "
    "get_unscaled_state _apply_scale".split()
)
_FIRST_KNOWN, _FIRST_WITH_REMAINDERS = Version("1.13.0.dev0"), Version("2.1.0.dev0")


class _FusedAdamAttributes(Protocol):
    """What the adopters read of TE's FusedAdam beyond ``torch.optim.Optimizer``."""

    master_weights: bool
    store_param_remainders: bool
    name_to_dtype_map: Dict[str, torch.dtype]
    _scales: Dict[torch.Tensor, Dict[str, torch.Tensor]]

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """The state ``state_name`` of ``param`` in FP32 (or int16 remainders)."""


def _fused_adam(optimizer: torch.optim.Optimizer) -> _FusedAdamAttributes:
    """``optimizer`` as the FusedAdam the checks found it to be."""
    return cast(_FusedAdamAttributes, optimizer)


def fused_adam_problem(
    optimizer: torch.optim.Optimizer,
    fused_adam_class: Optional[type],
    methods: Tuple[str, ...] = _STATE_METHODS,
) -> Optional[str]:
    """Accept TE's FusedAdam (among the imported modules; TE is never imported here) and
    subclasses and instances that do not override any of ``methods``."""
    module = sys.modules.get("transformer_engine.pytorch.optimizers.fused_adam")
    fused_adam = fused_adam_class or getattr(module, "FusedAdam", None)
    if not isinstance(fused_adam, type):
        return "Transformer Engine's FusedAdam is not loaded"
    cls = type(optimizer)
    if not issubclass(cls, fused_adam):
        return f"the inner optimizer is {cls.__qualname__}, not FusedAdam"
    for method in methods:
        if getattr(cls, method, None) is not getattr(fused_adam, method, None):
            return f"{cls.__qualname__} overrides FusedAdam.{method}"
        if method in getattr(optimizer, "__dict__", {}):
            return f"the {cls.__qualname__} instance has its own {method}"
    return None


def _as_state_of(param: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` as TE holds the state of ``param``: a DTensor of its layout where it is one."""
    if not isinstance(param, DTensor):
        return shard
    return DTensor.from_local(
        shard,
        device_mesh=param.device_mesh,
        placements=param.placements,
        shape=param.size(),
        stride=param.stride(),
    )


class _TEFusedAdamAdopter(StateAdopter):
    """The class both recognise (``fused_adam_class``: a stand-in in CPU tests; default TE's),
    the device type of every parameter and state tensor, the TE release (default
    ``get_te_version()``), and the owner's precision mode."""

    precision_aware = False

    def __init__(
        self,
        fused_adam_class: Optional[type] = None,
        device_type: str = "cuda",
        te_version: Optional[str] = None,
    ) -> None:
        self._fused_adam_class, self._device_type = fused_adam_class, device_type
        self._te_version = te_version

    def _mode_problem(
        self,
        context: AdoptionContext,
        settings_problem: Callable[[torch.optim.Optimizer], Optional[str]],
    ) -> Optional[str]:
        return (  # in order: each check relies on the ones before
            checks.owner_problem(context, self.precision_aware)
            or fused_adam_problem(context.optimizer, self._fused_adam_class)
            or settings_problem(context.optimizer)
        )


class TEFusedAdamFP32StateAdopter(_TEFusedAdamAdopter):
    """Installs FP32 Adam moments by reference: PyTorch's loader alone keeps them. Creates the
    state a checkpoint is read into in one allocation."""

    name = "te_fused_adam_fp32"

    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """None if every eligibility rule holds, else the first that fails."""
        fp32 = dict.fromkeys(MOMENT_KEYS, torch.float32)
        return self._mode_problem(context, self._settings_problem) or checks.incoming_state_problem(
            context, self._param_problem, lambda param: fp32
        )

    def adopt(self, context: AdoptionContext) -> None:
        """PyTorch's loader (FusedAdam's first half): installs the groups, TE's ``step``
        included, and keeps tensors of the parameter's dtype and device as they are."""
        assert context.state_dict is not None
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))

    def initialize_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Accept what the load accepts of the optimizer and its parameters, and TE's own step
        (where one follows: it advances each group's ``step`` and skips the parameters without
        gradients, launching no kernel)."""
        return (
            self._mode_problem(context, self._settings_problem)
            or fused_adam_problem(context.optimizer, self._fused_adam_class, ("step",))
            or checks.params_problem(context.optimizer, self._param_problem)
        )

    def initialize(self, context: AdoptionContext) -> None:
        """Every parameter's zeroed FP32 moments, as views of one allocation per device, not one
        each as TE creates them (see :mod:`.allocation`)."""
        params = checks.params_of(context.optimizer)
        likes = [checks.local(param) for param in params for _ in MOMENT_KEYS]
        moments = iter(packed_zeros(likes, torch.float32))
        for param in params:
            context.optimizer.state[param] = {
                key: _as_state_of(param, next(moments)) for key in MOMENT_KEYS
            }

    def _settings_problem(self, optimizer: torch.optim.Optimizer) -> Optional[str]:
        """FP32 moments, no master weights, no remainders (absent only before TE 2.1)."""
        try:
            te_version = Version(self._te_version) if self._te_version else get_te_version()
        except InvalidVersion:
            te_version = None
        dtypes = getattr(optimizer, "name_to_dtype_map", None)
        if not hasattr(optimizer, "master_weights"):
            return "FusedAdam has no 'master_weights'"
        if _fused_adam(optimizer).master_weights:
            return "FusedAdam.master_weights is set"
        if getattr(optimizer, "store_param_remainders", False):
            return "FusedAdam.store_param_remainders is set"
        if not hasattr(optimizer, "store_param_remainders"):
            if te_version is None:
                return "FusedAdam has no 'store_param_remainders' and the TE release is unknown"
            if te_version < _FIRST_KNOWN:
                return (
                    f"Transformer Engine {te_version} predates 1.13, "
                    "the first release this adopter knows"
                )
            if te_version >= _FIRST_WITH_REMAINDERS:
                return (
                    "FusedAdam has no 'store_param_remainders', "
                    f"which Transformer Engine {te_version} sets"
                )
        if not isinstance(dtypes, Mapping):
            return "FusedAdam has no 'name_to_dtype_map'"
        for key in MOMENT_KEYS:
            if dtypes.get(key) is not torch.float32:
                return f"FusedAdam keeps {key} in {dtypes.get(key)}, not torch.float32"
        return None

    def _param_problem(self, param: torch.Tensor) -> Optional[str]:
        """Plain FP32 parameters on the device type, or DTensors of them (Megatron-FSDP)."""
        if type(checks.local(param)) not in (torch.Tensor, torch.nn.Parameter):
            return f"is a {type(param).__name__}, not a plain tensor or a DTensor of one"
        if param.dtype != torch.float32:
            return f"is {param.dtype}, not torch.float32"
        if param.device.type != self._device_type:
            return f"is on {param.device}, not on {self._device_type}"
        return None


class TEFusedAdamPrecisionAwareStateAdopter(_TEFusedAdamAdopter):
    """Creates the state a checkpoint is read into as TE does, in one allocation per dtype;
    installs MCore's scaffold by reference (TE's scales of one), exports the held tensors,
    offers the held BF16 moments as read targets (``torch_dist`` casts into them as TE's
    ``copy_(fp32.bfloat16())``) and keeps the held state handed back. A payload holding a NaN
    declines (TE's loader makes it canonical).

    Opt-in. Megatron-Core registers one as ``te_fused_adam_bf16``, which acts where
    ``OptimizerConfig.precision_aware_optimizer_state_adoption`` is set. An instance made
    without ``requires_config_opt_in`` needs no config field: that is how a launcher that
    cannot set the field opts in, e.g. a plugin whose entry point names this class.

    Args:
        fused_adam_class (type, optional): the FusedAdam class (a stand-in in CPU tests).
        device_type (str): the device type of every parameter and state tensor.
        te_version (str, optional): the TE release; default ``get_te_version()``.
        name (str): the adopter's name.
        requires_config_opt_in (bool): act only where the owner's config opts in.
    """

    precision_aware = True
    installed_attributes = ("_scales",)

    def __init__(
        self,
        fused_adam_class: Optional[type] = None,
        device_type: str = "cuda",
        te_version: Optional[str] = None,
        *,
        name: str = "te_fused_adam_precision_aware",
        requires_config_opt_in: bool = False,
    ) -> None:
        super().__init__(fused_adam_class, device_type, te_version)
        self._name, self._requires_config_opt_in = name, requires_config_opt_in

    @property
    def name(self) -> str:
        """The adopter's name."""
        return self._name

    def decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Accept a payload to keep in the held state, or a scaffold to install.

        The payload (the held state handed back) holds checkpoint values: one holding a NaN
        declines. A scaffold is state the call site built (``owns_state_dict``) and fills from the
        checkpoint afterwards, through the read targets: installed as it is, uninitialized
        memory included.
        """
        reason = self._opt_in_problem(context) or self._mode_problem(
            context, _bf16_settings_problem
        )
        if reason is not None:
            return reason
        payload = self._payload_problem(context)
        if payload is None:
            assert context.state_dict is not None
            return _nan_problem(checks.tensors_of(context.state_dict["state"]))
        expected = partial(_expected, context.optimizer)
        scaffold = checks.incoming_state_problem(context, self._param_problem, expected)
        return None if scaffold is None else f"no payload ({payload}), no scaffold ({scaffold})"

    def adopt(self, context: AdoptionContext) -> None:
        """Install the scaffold by reference, or keep the held state handed back (the payload:
        each incoming tensor is the held one), with TE's scales of one."""
        optimizer = context.optimizer
        assert context.state_dict is not None
        pairs = list(checks.paired_state(optimizer, context.state_dict))
        held = {id(param): optimizer.state.get(param, {}) for _, param, _ in pairs}
        # PyTorch's loader would cast master weights to the BF16 parameters' dtype: groups only.
        torch.optim.Optimizer.load_state_dict(
            optimizer, {"state": {}, "param_groups": list(context.state_dict["param_groups"])}
        )
        for _, param, incoming in pairs:
            optimizer.state[param] = dict(incoming)
            for key, value in incoming.items():
                if value is not held[id(param)].get(key):  # the payload keeps its checked scales
                    _give_scale_of_one(optimizer, param, key)

    def initialize_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Accept what the load accepts of the optimizer and its parameters."""
        return (
            self._opt_in_problem(context)
            or self._mode_problem(context, _bf16_settings_problem)
            or checks.params_problem(context.optimizer, self._param_problem)
        )

    def initialize(self, context: AdoptionContext) -> None:
        """Every parameter's state as TE's ``initialize_state`` creates it (zeroed BF16 moments,
        zeroed int16 remainders or FP32 master weights copied from the parameter, scales of one),
        the tensors of each dtype views of one allocation per device (see :mod:`.allocation`)."""
        optimizer = context.optimizer
        layout = [
            (param, key, dtype)
            for param in checks.params_of(optimizer)
            for key, dtype in _expected(optimizer, param).items()
        ]
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for index, (_, _, dtype) in enumerate(layout):
            by_dtype.setdefault(dtype, []).append(index)
        created: Dict[int, torch.Tensor] = {}
        for dtype, indices in by_dtype.items():
            created.update(zip(indices, packed_zeros([layout[i][0] for i in indices], dtype)))
        for index, (param, key, dtype) in enumerate(layout):
            if key == "master_param" and dtype == torch.float32:
                created[index].copy_(param.detach())
            optimizer.state[param][key] = created[index]
            _give_scale_of_one(optimizer, param, key)

    def export_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Accept a held state laid out as TE's loader leaves it, with scales of one."""
        return (
            self._opt_in_problem(context)
            or self._mode_problem(context, _bf16_settings_problem)
            or self._held_problem(context)
        )

    def export_state_dict(self, context: AdoptionContext) -> Dict[str, Any]:
        """PyTorch's state dict of the FusedAdam: its groups and the held tensors themselves."""
        return checks.held_state_dict(context.optimizer)

    def read_target_decline_reason(self, context: AdoptionContext) -> Optional[str]:
        """Accept what the export accepts, for an optimizer that has not stepped (a read
        failing midway would overwrite trained state)."""
        if any(group.get("step") for group in context.optimizer.param_groups):
            return "a param group has stepped: its held state may be trained state"
        return self.export_decline_reason(context)

    def read_target(self, context: AdoptionContext, param: torch.Tensor, name: str) -> torch.Tensor:
        """The held BF16 moment; for master weights TE's own target (the held tensor)."""
        if name in MOMENT_KEYS:
            held: torch.Tensor = context.optimizer.state[param][name]
            return held
        return _fused_adam(context.optimizer).get_unscaled_state(param, name)

    def _opt_in_problem(self, context: AdoptionContext) -> Optional[str]:
        field = "precision_aware_optimizer_state_adoption"
        opted_in = getattr(context.config, field, False)
        if not self._requires_config_opt_in or opted_in is True:
            return None
        if opted_in is False:
            return f"OptimizerConfig.{field} is not set"
        return f"OptimizerConfig.{field} is {opted_in!r}, not True or False"

    def _param_problem(self, param: torch.Tensor) -> Optional[str]:
        """Plain floating-point parameters on the device type."""
        if type(param) not in (torch.Tensor, torch.nn.Parameter):
            return f"a parameter is a {type(param).__name__}, not a plain tensor"
        if not param.is_floating_point() or param.device.type != self._device_type:
            return f"a parameter is {param.dtype} on {param.device}"
        return None

    def _held_problem(self, context: AdoptionContext) -> Optional[str]:
        """Every parameter holds the state TE's loader lays out, each BF16 scale one."""
        optimizer = context.optimizer
        if not optimizer.state:
            return "the optimizer holds no state yet"
        held = replace(context, state_dict=checks.held_state_dict(optimizer), owns_state_dict=False)
        reason = checks.incoming_state_problem(
            held, self._param_problem, partial(_expected, optimizer)
        )
        if reason is not None:
            return f"the held state: {reason.replace('incoming ', '')}"
        scales, held_scales = [], _fused_adam(optimizer)._scales
        for index, param in enumerate(checks.params_of(optimizer)):
            for key, dtype in _expected(optimizer, param).items():
                scale = held_scales.get(param, {}).get(key)
                if dtype != torch.bfloat16:
                    continue
                if not (isinstance(scale, torch.Tensor) and scale.numel() == 1):
                    return f"parameter {index}: held {key} has no scale"
                scales.append(scale.reshape(1).float())
        if scales and not bool(torch.cat([s.to(scales[0].device) for s in scales]).eq(1).all()):
            return "a scale of the held BF16 state is not one"
        return None

    def _payload_problem(self, context: AdoptionContext) -> Optional[str]:
        """The incoming state is the held state itself (its export: MCore's payload pass)."""
        optimizer, given = context.optimizer, context.state_dict
        reason = checks.param_groups_problem(optimizer, given) or self._held_problem(context)
        if reason is not None:
            return reason
        assert given is not None
        held = checks.held_state_dict(optimizer)["state"]
        return checks.mismatch(given["state"], held, "the incoming state")


def _give_scale_of_one(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str) -> None:
    """TE's scale of one for state ``key`` of ``param`` where TE keeps it in another dtype than
    FP32 (``_initialize_state`` and its loader give each such state one)."""
    fused_adam = _fused_adam(optimizer)
    if fused_adam.name_to_dtype_map[key] != torch.float32:
        scale = torch.ones([1], dtype=torch.float32, device=param.device)
        fused_adam._scales.setdefault(param, {})[key] = scale


def _bf16_settings_problem(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """BF16 moments; with master weights, FP32 ones."""
    for attribute in ("master_weights", "store_param_remainders", "name_to_dtype_map", "_scales"):
        if not hasattr(optimizer, attribute):
            return f"FusedAdam has no '{attribute}'"
    fused_adam = _fused_adam(optimizer)
    dtypes = fused_adam.name_to_dtype_map
    wrong = [key for key in MOMENT_KEYS if dtypes.get(key) is not torch.bfloat16]
    if fused_adam.master_weights and dtypes.get("master_param") is not torch.float32:
        wrong.append("master_param")
    return f"FusedAdam keeps {wrong[0]} in {dtypes.get(wrong[0])}" if wrong else None


def _expected(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> checks.ExpectedState:
    """The keys and dtypes TE's loader leaves for ``param`` under the precision-aware optimizer."""
    expected = dict.fromkeys(MOMENT_KEYS, torch.bfloat16)
    fused_adam = _fused_adam(optimizer)
    if fused_adam.master_weights:
        remainders = fused_adam.store_param_remainders and param.dtype == torch.bfloat16
        expected["master_param"] = torch.int16 if remainders else torch.float32
    return expected


def _nan_problem(tensors: List[torch.Tensor]) -> Optional[str]:
    """Decline BF16 state holding a NaN, which TE's loader makes canonical (``.float().bfloat16()``
    changes nothing else): one NaN-propagating maximum per tensor and one synchronization for all,
    with no transient beyond a scalar per tensor."""
    maxima = [checks.local(t).amax() for t in tensors if t.dtype == torch.bfloat16 and t.numel()]
    if maxima and bool(torch.stack([m.to(maxima[0].device) for m in maxima]).isnan().any()):
        return "the incoming BF16 state holds a NaN, which TE's loader makes canonical"
    return None
