"""A CPU stand-in for Transformer Engine's ``FusedAdam`` (TE 2.x), for tests without a GPU.

Transformer Engine cannot be imported without CUDA, so CPU tests cannot use the real
class. This stand-in is written from the behaviour of
``transformer_engine.pytorch.optimizers.fused_adam.FusedAdam`` in TE 2.20 that checkpoint
loading depends on, and reproduces it:

* attributes ``master_weights``, ``store_param_remainders`` (only kept with FP32 master
  weights) and ``name_to_dtype_map`` (``exp_avg``/``exp_avg_sq``/``master_param`` dtypes);
* ``load_state_dict``: runs ``torch.optim.Optimizer.load_state_dict``, then for every
  parameter resets its state to ``{}`` and, for each incoming key, *allocates a new
  tensor* of the configured dtype (``_initialize_state``: ``torch.empty_like``) and copies
  the incoming value into it (``set_scaled_state``) — the allocate-and-copy that doubles
  the moments' memory while the caller still holds the incoming tensors;
* ``state_dict``: non-FP32 state is returned as FP32 copies, FP32 state as is;
* ``step``: AdamW with a per-group ``step`` counter, as TE keeps it; like TE it advances every
  group's ``step`` and creates the state of every parameter without state (zeroed moments)
  before it skips the parameters without a gradient.

* precision-aware state: BF16 moments (stored as BF16 copies of the FP32 input, with a
  ``_scales`` entry of ones per moment, as TE creates it), TE master weights
  (``master_param`` in FP32, or as int16 remainders of BF16 parameters with
  ``store_param_remainders``), and the public ``initialize_state``.

Transformer Engine generations (``te_release``, see docs/te-releases.md): from 2.1 on the
instance has ``store_param_remainders`` and the loader skips ``None`` values (the default,
``(2, 20)``); in 2.0 there is no ``store_param_remainders`` attribute and no remainder mode;
in 1.13 and 1.14 additionally a ``None`` state value makes the loader fail. Every release from
1.13 to 2.20 allocates and copies on load.

DTensor parameters (Megatron-FSDP's, FSDP2's) as TE 2.20 handles them: state is allocated
like the parameter's local shard and wrapped again as a DTensor with the parameter's device
mesh, placements, shape and stride; the loader unwraps incoming DTensors to their local shards
before copying; ``state_dict`` returns the state re-wrapped as DTensors; ``step`` works on the
local shards.

Every state tensor it allocates is counted in ``allocations`` so tests can prove that an
adopter allocated nothing. Not reproduced: FP16/FP8 scaled moments, and ``step`` with
master weights on a parameter with a gradient (it raises).
"""

from itertools import chain
from typing import Any, Dict, Iterable, Tuple

import torch
from torch.distributed.tensor import DTensor


def _local(tensor: Any) -> Any:
    """A DTensor's local shard, or the tensor itself (TE reads ``_local_tensor``)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _as_dtensor_like(param: torch.Tensor, local: torch.Tensor) -> Any:
    """``local`` wrapped as a DTensor laid out like the DTensor ``param``, as TE wraps state."""
    return DTensor.from_local(
        local,
        device_mesh=param.device_mesh,
        placements=param.placements,
        shape=param.size(),
        stride=param.stride(),
    )


class FusedAdamStandIn(torch.optim.Optimizer):
    """CPU stand-in for TE FusedAdam's state handling (see the module docstring)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        store_param_remainders: bool = False,
        te_release: Tuple[int, int] = (2, 20),
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.master_weights = master_weights
        self.te_release = te_release
        if te_release >= (2, 1):
            self.store_param_remainders = (
                store_param_remainders and master_weights and master_weight_dtype == torch.float32
            )
        elif store_param_remainders:
            raise TypeError(f"TE {te_release} has no store_param_remainders")
        self.name_to_dtype_map = {
            "exp_avg": exp_avg_dtype,
            "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        self.allocations = 0
        self._scales: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}

    def _keeps_remainders(self, param: torch.Tensor, state_name: str) -> bool:
        return (
            getattr(self, "store_param_remainders", False)
            and state_name == "master_param"
            and param.dtype == torch.bfloat16
        )

    def _initialize_state(
        self, param: torch.Tensor, state_name: str, zero_buffer: bool, store_param_remainders: bool = False
    ) -> None:
        """Allocate one state tensor of the configured dtype (int16 for remainders), as TE does."""
        dtype = self.name_to_dtype_map[state_name]
        local_param = _local(param)
        if store_param_remainders:
            data = torch.zeros_like(local_param, dtype=torch.int16)
        else:
            data = torch.empty_like(local_param, dtype=dtype)
        if zero_buffer:
            data.zero_()
        self.allocations += 1
        self.state[param][state_name] = data
        if isinstance(param, DTensor):
            self.state[param][state_name] = _as_dtensor_like(param, data)
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[state_name] = torch.ones([1], dtype=torch.float32)

    def initialize_state(self, param: torch.Tensor, store_param_remainders: bool = False) -> None:
        """Zeroed moments and, with master weights, the master copy of ``param``, as TE does."""
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", False, store_param_remainders)
            if not store_param_remainders:
                self.set_scaled_state(param, "master_param", param.clone().detach().float())

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled: torch.Tensor) -> None:
        """Copy ``unscaled`` into the parameter's state (BF16: a BF16 copy), allocating it if missing."""
        remainders = self._keeps_remainders(param, state_name)
        assert unscaled.dtype == (torch.int16 if remainders else torch.float32)
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, False, remainders)
        target = _local(self.state[param][state_name])
        dtype = self.name_to_dtype_map[state_name]
        if dtype == torch.bfloat16:
            target.copy_(unscaled.bfloat16())
        elif dtype == torch.float32:
            target.copy_(unscaled)
        else:
            raise NotImplementedError(f"the stand-in does not reproduce {dtype} scaling")

    def get_unscaled_state(self, param: torch.Tensor, state_name: str) -> torch.Tensor:
        """Return the FP32 (or int16 remainder) tensor itself, or an FP32 copy of a BF16 state."""
        state = _local(self.state[param][state_name])
        return state if state.dtype in (torch.float32, torch.int16) else state.float()

    def state_dict(self) -> Dict[str, Any]:
        """PyTorch's state dict with every state tensor unscaled to FP32."""
        state_dict = super().state_dict()
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        for state_id, param in zip(ids, params):
            if state_id in state_dict["state"]:
                state_dict["state"][state_id] = {
                    name: self.get_unscaled_state(param, name)
                    for name in state_dict["state"][state_id]
                }
                if isinstance(param, DTensor):
                    state_dict["state"][state_id] = {
                        name: _as_dtensor_like(param, value)
                        for name, value in state_dict["state"][state_id].items()
                    }
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """PyTorch's loader, then re-allocate and copy every state tensor, as TE does."""
        super().load_state_dict(state_dict)
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        for state_id, param in zip(ids, params):
            if state_id in state_dict["state"]:
                incoming = state_dict["state"][state_id]
                self.state[param] = {}
                for name, value in incoming.items():
                    if value is None and self.te_release >= (2, 0):
                        continue
                    value = _local(value)
                    if self._keeps_remainders(param, name):
                        self.set_scaled_state(param, name, value)
                    else:
                        self.set_scaled_state(param, name, value.float())

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """One AdamW step; moments are read and written in their configured dtype."""
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            bias_correction1 = 1 - beta1 ** group["step"]
            bias_correction2 = 1 - beta2 ** group["step"]
            for param in group["params"]:
                state, local_param = self.state[param], _local(param)
                if len(state) == 0:  # TE initialises the state before it looks at the gradient
                    self.initialize_state(param, store_param_remainders=False)
                if param.grad is None:
                    continue
                if self.master_weights:
                    raise NotImplementedError("the stand-in does not reproduce master-weight updates")
                exp_avg = self.get_unscaled_state(param, "exp_avg")
                exp_avg_sq = self.get_unscaled_state(param, "exp_avg_sq")
                grad = _local(param.grad).float()
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq / bias_correction2).sqrt_().add_(group["eps"])
                local_param.mul_(1 - group["lr"] * group["weight_decay"])
                local_param.addcdiv_(exp_avg, denom, value=-group["lr"] / bias_correction1)
                _local(state["exp_avg"]).copy_(exp_avg)
                _local(state["exp_avg_sq"]).copy_(exp_avg_sq)
