"""The installed megatron-core's ``DistributedOptimizer.load_state_dict`` goes through the registry.

A full DistributedOptimizer needs CUDA buffers, so ``CpuDistributedOptimizer`` subclasses the
installed class and only sets what ``load_state_dict`` reads on the path where the inner
optimizer's state is already initialised (MCore's second load pass). ``load_state_dict``
itself is the installed, unmodified method. With plain upstream megatron-core (any supported
release, even with this subsystem importable) these tests fail: nothing consults the registry.
"""

import logging
import types
from typing import Any, Dict, List

import pytest
import torch
from adopters_for_tests import HalfInstallingAdopter, PyTorchLoaderAdopter
from builders import config_with, ddp_config_with

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import (
    StateAdoptionOutcome,
    register_outcome_hook,
    register_state_adopter,
)

DISABLE_ENV_VAR = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"


class CpuDistributedOptimizer(DistributedOptimizer):
    """The installed DistributedOptimizer with only the attributes load_state_dict reads."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, ddp_config: Any) -> None:
        self.optimizer = optimizer
        self.config = config
        self.ddp_config = ddp_config
        self.grad_scaler = None
        self.is_stub_optimizer = False


#: The keys MCore's ``_get_param_groups`` puts in every param group (0.16.1 to 0.19.2).
#: ``load_state_dict`` pairs saved and current groups by some of them; before 0.19 it
#: raises ``ValueError: Key wd_mult (or pre_wd_mult) not found`` for a group without them.
MCORE_PARAM_GROUP_KEYS: Dict[str, Any] = {
    "is_expert_parallel": False, "default_config": True, "wd_mult": 1.0, "lr_mult": 1.0,
    "is_decoupled_lr": False, "max_lr": 1e-3, "min_lr": 0.0,
}


def _trained_adam(seed: int) -> torch.optim.Adam:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(10,), (4, 3)]]
    optimizer = torch.optim.Adam([{"params": params, **MCORE_PARAM_GROUP_KEYS}], lr=1e-3)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return optimizer


def _outer_state_dict(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """What MCore passes to DistributedOptimizer.load_state_dict (non-tensor part)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    for group in groups:
        group["step"] = 2
    return {"optimizer": {"param_groups": groups}}


def _state_tensors(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [optimizer.state[p][k] for g in optimizer.param_groups for p in g["params"] for k in ("exp_avg", "exp_avg_sq")]


def _distributed(seed: int = 0, **config_changes: Any) -> CpuDistributedOptimizer:
    return CpuDistributedOptimizer(
        _trained_adam(seed), config_with(**config_changes), DistributedDataParallelConfig()
    )


@pytest.fixture
def adam_adopter():
    adopter = PyTorchLoaderAdopter("test_torch_adam", torch.optim.Adam)
    handle = register_state_adopter(adopter, prepend=True)
    yield adopter
    handle.remove()


def test_load_state_dict_consults_registered_adopters(adam_adopter: PyTorchLoaderAdopter, caplog) -> None:
    distributed = _distributed()
    before = _state_tensors(distributed.optimizer)
    with caplog.at_level(logging.INFO, logger="megatron.core.optimizer.state_adoption"):
        distributed.load_state_dict(_outer_state_dict(distributed.optimizer))
    assert len(adam_adopter.adopted) == 1
    context = adam_adopter.adopted[0]
    assert context.optimizer is distributed.optimizer and context.config is distributed.config
    assert context.ddp_config is distributed.ddp_config and context.is_stub_optimizer is False
    assert sorted(context.state_dict) == ["param_groups", "state"]
    assert all(a is b for a, b in zip(_state_tensors(distributed.optimizer), before))
    assert "'test_torch_adam' installed the Adam state" in caplog.text


def test_default_adopter_declines_torch_adam_with_a_logged_reason(caplog) -> None:
    distributed = _distributed()
    with caplog.at_level(logging.DEBUG, logger="megatron.core.optimizer.state_adoption"):
        distributed.load_state_dict(_outer_state_dict(distributed.optimizer))
    assert "'te_fused_adam_fp32' declined: Transformer Engine's FusedAdam is not loaded" in caplog.text
    assert "(every adopter declined): Adam.load_state_dict runs" in caplog.text


def test_kill_switch_reaches_distributed_optimizer(adam_adopter, monkeypatch, caplog) -> None:
    monkeypatch.setenv(DISABLE_ENV_VAR, "1")
    distributed = _distributed()
    with caplog.at_level(logging.DEBUG, logger="megatron.core.optimizer.state_adoption"):
        distributed.load_state_dict(_outer_state_dict(distributed.optimizer))
    assert adam_adopter.checked == []
    assert f"{DISABLE_ENV_VAR} is set" in caplog.text


def test_failing_adopter_leaves_distributed_optimizer_correctly_loaded(caplog) -> None:
    distributed = _distributed()
    reference = _distributed()
    handle = register_state_adopter(HalfInstallingAdopter(), prepend=True)
    try:
        with caplog.at_level(logging.WARNING, logger="megatron.core.optimizer.state_adoption"):
            distributed.load_state_dict(_outer_state_dict(distributed.optimizer))
    finally:
        handle.remove()
    assert "failed while installing" in caplog.text
    assert len(distributed.optimizer.param_groups) == 1
    for a, b in zip(_state_tensors(distributed.optimizer), _state_tensors(reference.optimizer)):
        assert torch.equal(a, b)


def test_chained_optimizer_goes_through_each_distributed_optimizer(adam_adopter) -> None:
    dense, expert = _distributed(seed=0), _distributed(seed=1)
    chained = ChainedOptimizer([dense, expert])
    chained.load_state_dict([_outer_state_dict(dense.optimizer), _outer_state_dict(expert.optimizer)])
    assert [c.optimizer for c in adam_adopter.adopted] == [dense.optimizer, expert.optimizer]


def test_megatron_fsdp_path_is_unchanged(adam_adopter) -> None:
    distributed = CpuDistributedOptimizer(
        _trained_adam(0), OptimizerConfig(), ddp_config_with(use_megatron_fsdp=True)
    )
    distributed.load_state_dict(distributed.optimizer.state_dict())
    assert adam_adopter.checked == []


class _AdamExporter(PyTorchLoaderAdopter):
    """Adopts torch Adam and exports PyTorch's state dict of it, counting both."""

    def __init__(self) -> None:
        super().__init__("test_torch_adam_exporter", torch.optim.Adam)
        self.exported: List[Any] = []

    def export_decline_reason(self, context: Any) -> Any:
        return None if isinstance(context.optimizer, torch.optim.Adam) else "not Adam"

    def export_state_dict(self, context: Any) -> Any:
        self.exported.append(context)
        return torch.optim.Optimizer.state_dict(context.optimizer), 123


def test_both_hook_points_are_consulted_and_every_call_has_an_outcome() -> None:
    exporter = _AdamExporter()
    outcomes: List[StateAdoptionOutcome] = []
    handles = [register_state_adopter(exporter, prepend=True), register_outcome_hook(outcomes.append)]
    try:
        distributed = _distributed()
        distributed.load_state_dict(_outer_state_dict(distributed.optimizer))
    finally:
        for handle in handles:
            handle.remove()
    assert [c.optimizer for c in exporter.exported] == [distributed.optimizer]
    assert [c.optimizer for c in exporter.adopted] == [distributed.optimizer]
    assert [(o.hook_point, o.adopter, o.avoided_bytes) for o in outcomes] == [
        ("export", "test_torch_adam_exporter", 123),
        ("load", "test_torch_adam_exporter", sum(t.nbytes for s in distributed.optimizer.state.values() for t in s.values())),
    ]


def test_an_instance_level_loader_on_the_inner_optimizer_runs_instead_of_any_adopter(adam_adopter) -> None:
    distributed = _distributed()
    calls: List[Dict[str, Any]] = []

    def load_state_dict(self: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        calls.append(state_dict)
        torch.optim.Optimizer.load_state_dict(self, state_dict)

    distributed.optimizer.load_state_dict = types.MethodType(load_state_dict, distributed.optimizer)  # type: ignore[method-assign]
    distributed.load_state_dict(_outer_state_dict(distributed.optimizer))
    assert len(calls) == 1 and sorted(calls[0]) == ["param_groups", "state"]
    assert adam_adopter.adopted == [] and len(adam_adopter.checked) == 1
