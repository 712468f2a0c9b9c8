"""The installed megatron-core's ``DistributedOptimizer.load_state_dict`` goes through the registry.

These are the routing tests CI runs against every supported megatron-core release: they pass
against the composed X+stateadoption and fail (never error) against unpatched upstream X with
this subsystem copied in, where nothing consults the registry and no outcome is recorded.

A full DistributedOptimizer needs CUDA buffers, so ``CpuDistributedOptimizer``
(:mod:`mcore_owners`) subclasses the installed class and only sets what ``load_state_dict``
reads on the path where the inner optimizer's state is already initialised (MCore's second load
pass). ``load_state_dict`` itself is the installed, unmodified method. The other call sites
(Megatron-FSDP, the non-distributed optimizers) are in test_call_site_integration.py. What each hook point did is read from the
outcomes (``register_outcome_hook``), not from log text.
"""

import dataclasses
import logging
import types
from typing import Any, Dict, Iterator, List

import pytest
import torch
from adopters_for_tests import HalfInstallingAdopter, PyTorchLoaderAdopter
from builders import config_with
from mcore_owners import MCORE_PARAM_GROUP_KEYS, CpuDistributedOptimizer

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import (
    StateAdoptionOutcome,
    register_state_adopter,
)

DISABLE_ENV_VAR = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"
ADOPTION_LOGGER = "megatron.core.optimizer.state_adoption"


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


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Every byte of the held state (Adam's moments and its 0-d ``step`` tensors)."""
    return sum(t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))


def _distributed(seed: int = 0, **config_changes: Any) -> CpuDistributedOptimizer:
    return CpuDistributedOptimizer(
        _trained_adam(seed), config_with(**config_changes), DistributedDataParallelConfig()
    )


def _load(distributed: CpuDistributedOptimizer) -> None:
    distributed.load_state_dict(_outer_state_dict(distributed.optimizer))


@pytest.fixture
def adam_adopter() -> Iterator[PyTorchLoaderAdopter]:
    adopter = PyTorchLoaderAdopter("test_torch_adam", torch.optim.Adam)
    handle = register_state_adopter(adopter, prepend=True)
    yield adopter
    handle.remove()


def _by_hook_point(outcomes: List[StateAdoptionOutcome]) -> List[Any]:
    return [(o.hook_point, o.adopter) for o in outcomes]


def test_load_state_dict_consults_registered_adopters(
    adam_adopter: PyTorchLoaderAdopter, outcomes: List[StateAdoptionOutcome], caplog: pytest.LogCaptureFixture
) -> None:
    distributed = _distributed()
    before = _state_tensors(distributed.optimizer)
    with caplog.at_level(logging.INFO, logger=ADOPTION_LOGGER):
        _load(distributed)
    assert len(adam_adopter.adopted) == 1
    context = adam_adopter.adopted[0]
    assert context.optimizer is distributed.optimizer and context.config is distributed.config
    assert context.ddp_config is distributed.ddp_config and context.is_stub_optimizer is False
    assert sorted(context.state_dict) == ["param_groups", "state"]
    assert all(a is b for a, b in zip(_state_tensors(distributed.optimizer), before))
    assert _by_hook_point(outcomes) == [("export", None), ("load", "test_torch_adam")]
    load = outcomes[1]
    assert load.reused_bytes == _state_bytes(distributed.optimizer) and load.allocated_bytes == 0
    assert load.optimizer.startswith(f"Adam {id(distributed.optimizer):#x} (2 params, 22 elements)")
    assert f"'test_torch_adam' installed the state of {load.optimizer}" in caplog.text


def test_default_adopter_declines_torch_adam_and_the_own_loader_runs(outcomes: List[StateAdoptionOutcome]) -> None:
    distributed = _distributed()
    _load(distributed)
    assert _by_hook_point(outcomes) == [("export", None), ("load", None)]
    load = outcomes[1]
    assert ("te_fused_adam_fp32", "Transformer Engine's FusedAdam is not loaded") in load.declines
    assert load.fallback_reason == "every adopter declined" and load.method == "Adam.load_state_dict"
    assert load.error is None


def test_the_config_switch_on_a_distributed_optimizer_selects_the_own_methods(
    adam_adopter: PyTorchLoaderAdopter, outcomes: List[StateAdoptionOutcome], caplog: pytest.LogCaptureFixture
) -> None:
    """``OptimizerConfig(optimizer_state_adoption=False)`` (a field of the composed build's
    config, True by default) makes both hook points run the inner optimizer's own methods
    without asking any adopter; the result is upstream's."""
    assert OptimizerConfig().optimizer_state_adoption is True
    distributed, reference = _distributed(optimizer_state_adoption=False), _distributed()
    with caplog.at_level(logging.INFO, logger=ADOPTION_LOGGER):
        _load(distributed)
    assert adam_adopter.checked == [] and adam_adopter.adopted == []
    assert [(o.hook_point, o.adopter, o.method, o.fallback_reason, o.declines) for o in outcomes] == [
        ("export", None, "Adam.state_dict", "OptimizerConfig.optimizer_state_adoption is False", ()),
        ("load", None, "Adam.load_state_dict", "OptimizerConfig.optimizer_state_adoption is False", ()),
    ]
    assert "(OptimizerConfig.optimizer_state_adoption is False)" in caplog.text  # the load, at INFO
    reference.optimizer.load_state_dict(reference.optimizer.state_dict())
    for a, b in zip(_state_tensors(distributed.optimizer), _state_tensors(reference.optimizer)):
        assert torch.equal(a, b)
    switched_on = CpuDistributedOptimizer(
        _trained_adam(0), dataclasses.replace(distributed.config, optimizer_state_adoption=True),
        DistributedDataParallelConfig(),
    )  # fmt: skip
    _load(switched_on)
    assert [c.optimizer for c in adam_adopter.adopted] == [switched_on.optimizer]


def test_kill_switch_reaches_distributed_optimizer(
    adam_adopter: PyTorchLoaderAdopter, outcomes: List[StateAdoptionOutcome], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Hole 4: an active kill switch is logged at INFO (with the load's outcome), not only at DEBUG."""
    monkeypatch.setenv(DISABLE_ENV_VAR, "1")
    distributed = _distributed()
    with caplog.at_level(logging.INFO, logger=ADOPTION_LOGGER):
        _load(distributed)
    assert adam_adopter.checked == []
    assert [(o.hook_point, o.adopter, o.fallback_reason) for o in outcomes] == [
        ("export", None, f"{DISABLE_ENV_VAR}=1 is set"),
        ("load", None, f"{DISABLE_ENV_VAR}=1 is set"),
    ]
    assert f"({DISABLE_ENV_VAR}=1 is set)" in caplog.text  # the active switch is logged at INFO


def test_failing_adopter_leaves_distributed_optimizer_correctly_loaded(
    outcomes: List[StateAdoptionOutcome], caplog: pytest.LogCaptureFixture
) -> None:
    distributed = _distributed()
    reference = _distributed()
    handle = register_state_adopter(HalfInstallingAdopter(), prepend=True)
    try:
        with caplog.at_level(logging.WARNING, logger=ADOPTION_LOGGER):
            _load(distributed)
    finally:
        handle.remove()
    assert "failed while installing" in caplog.text
    load = [o for o in outcomes if o.hook_point == "load"]
    assert [(o.adopter, o.fallback_reason) for o in load] == [
        (None, "adopter 'half_installing' failed while installing the state")
    ]
    assert len(distributed.optimizer.param_groups) == 1
    assert distributed.optimizer.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"]
    for a, b in zip(_state_tensors(distributed.optimizer), _state_tensors(reference.optimizer)):
        assert torch.equal(a, b)


def test_chained_optimizer_goes_through_each_distributed_optimizer(
    adam_adopter: PyTorchLoaderAdopter, outcomes: List[StateAdoptionOutcome]
) -> None:
    """Each inner optimizer is loaded once, and its outcome tells it from the other one.

    Hole 6: outcomes named only the class, so a ChainedOptimizer's dense and expert optimizers
    looked identical.
    """
    dense, expert = _distributed(seed=0), _distributed(seed=1)
    chained = ChainedOptimizer([dense, expert])
    chained.load_state_dict([_outer_state_dict(dense.optimizer), _outer_state_dict(expert.optimizer)])
    assert [c.optimizer for c in adam_adopter.adopted] == [dense.optimizer, expert.optimizer]
    loads = [o.optimizer for o in outcomes if o.hook_point == "load"]
    assert [label.split()[1] for label in loads] == [f"{id(dense.optimizer):#x}", f"{id(expert.optimizer):#x}"]


class _AdamExporter(PyTorchLoaderAdopter):
    """Adopts torch Adam and exports PyTorch's state dict of it (the held tensors), counting both."""

    def __init__(self) -> None:
        super().__init__("test_torch_adam_exporter", torch.optim.Adam)
        self.exported: List[Any] = []

    def export_decline_reason(self, context: Any) -> Any:
        return None if isinstance(context.optimizer, torch.optim.Adam) else "not Adam"

    def export_state_dict(self, context: Any) -> Dict[str, Any]:
        self.exported.append(context)
        return torch.optim.Optimizer.state_dict(context.optimizer)


def test_both_hook_points_are_consulted_and_every_call_has_an_outcome(
    outcomes: List[StateAdoptionOutcome],
) -> None:
    exporter = _AdamExporter()
    handle = register_state_adopter(exporter, prepend=True)
    try:
        distributed = _distributed()
        held = _state_bytes(distributed.optimizer)
        _load(distributed)
    finally:
        handle.remove()
    assert [c.optimizer for c in exporter.exported] == [distributed.optimizer]
    assert [c.optimizer for c in exporter.adopted] == [distributed.optimizer]
    assert [(o.hook_point, o.adopter, o.reused_bytes, o.allocated_bytes) for o in outcomes] == [
        ("export", "test_torch_adam_exporter", held, 0),
        ("load", "test_torch_adam_exporter", _state_bytes(distributed.optimizer), 0),
    ]


def test_an_instance_level_loader_on_the_inner_optimizer_runs_instead_of_any_adopter(
    adam_adopter: PyTorchLoaderAdopter, outcomes: List[StateAdoptionOutcome]
) -> None:
    """Hole 6: under an instance-level loader (Megatron-Bridge's) the outcome read as "0 bytes
    avoided"; it now names the instance's method and measures what it installed by reference."""
    distributed = _distributed()
    calls: List[Dict[str, Any]] = []

    def load_state_dict(self: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        calls.append(state_dict)
        torch.optim.Optimizer.load_state_dict(self, state_dict)

    distributed.optimizer.load_state_dict = types.MethodType(load_state_dict, distributed.optimizer)  # type: ignore[method-assign]
    _load(distributed)
    assert len(calls) == 1 and sorted(calls[0]) == ["param_groups", "state"]
    assert adam_adopter.checked == [] and adam_adopter.adopted == []
    (load,) = [o for o in outcomes if o.hook_point == "load"]
    assert load.adopter is None and load.method == "load_state_dict set on the Adam instance"
    assert load.fallback_reason is not None and "instance has its own load_state_dict" in load.fallback_reason
    # the instance loader installed the tensors it was given: recorded as such, not as 0 bytes
    assert load.reused_bytes == _state_bytes(distributed.optimizer) and load.allocated_bytes == 0
