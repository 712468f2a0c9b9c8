"""Megatron-FSDP's state: DTensors of local shards, installed by reference (issue #19).

Megatron-FSDP's ``DistributedOptimizer`` (``fsdp_dtensor`` format) packs the inner optimizer's
own state entries into the sharded state dict, ``torch.distributed.checkpoint`` reads into them
in place, and ``load_state_dict`` hands them to TE FusedAdam, which unwraps each DTensor,
allocates a new local shard, copies and wraps it again with the parameter's mesh and placements.
These tests use real DTensors on a one-rank gloo group and the CPU stand-in, which reproduces
that loader (tests/fused_adam_standin.py).
"""

from typing import Any, Dict, List, Tuple

import pytest
import torch
from builders import ddp_config_with, load_through, registry_of, standin_adopter
from fused_adam_standin import FusedAdamStandIn
from mcore_owners import MCORE_PARAM_GROUP_KEYS, CpuDistributedOptimizer
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import StateAdoptionOutcome, register_outcome_hook, register_state_adopter

SHAPES = [(12,), (4, 3), (6,)]
FSDP = {"ddp_config": ddp_config_with(use_megatron_fsdp=True)}


def _dtensor(local: torch.Tensor, cpu_mesh: DeviceMesh, placement: Any = None) -> DTensor:
    return DTensor.from_local(local, cpu_mesh, [placement or Shard(0)], run_check=False)


def _params(cpu_mesh: DeviceMesh, shapes: List[Tuple[int, ...]] = SHAPES) -> List[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(_dtensor(torch.randn(s, generator=generator), cpu_mesh)) for s in shapes]


def _trained(cpu_mesh: DeviceMesh, shapes: List[Tuple[int, ...]] = SHAPES) -> FusedAdamStandIn:
    params = _params(cpu_mesh, shapes)
    optimizer = FusedAdamStandIn([{"params": params, **MCORE_PARAM_GROUP_KEYS}], lr=1e-3, weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        for param in params:  # no gradient for an empty shard, as Megatron-FSDP gives it none
            if param.to_local().numel() > 0:
                param.grad = _dtensor(torch.randn(param.to_local().shape, generator=generator), cpu_mesh)
        optimizer.step()
    return optimizer


def _read_in_place(optimizer: FusedAdamStandIn) -> Dict[str, Any]:
    """What Megatron-FSDP hands the loader: the optimizer's own state entries (read in place)."""
    return torch.optim.Optimizer.state_dict(optimizer)


def _locals(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [
        optimizer.state[p][k].to_local()
        for g in optimizer.param_groups
        for p in g["params"]
        if p in optimizer.state
        for k in ("exp_avg", "exp_avg_sq")
    ]


def _same_bits(left: List[torch.Tensor], right: List[torch.Tensor]) -> bool:
    return len(left) == len(right) and all(a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(left, right))


def test_te_stand_in_copies_dtensor_state_as_te_does(cpu_mesh: DeviceMesh) -> None:
    """The own loader: a new local shard per moment, wrapped like the parameter (8 B x params)."""
    optimizer = _trained(cpu_mesh)
    incoming = _read_in_place(optimizer)
    held = _locals(optimizer)
    outcome = load_through(optimizer, incoming, registry_of(), **FSDP)
    assert outcome.allocated_bytes == 8 * 30 and outcome.reused_bytes == 0
    assert all(isinstance(optimizer.state[p]["exp_avg"], DTensor) for p in optimizer.param_groups[0]["params"])
    assert _same_bits(_locals(optimizer), held)


def test_fsdp_dtensor_moments_are_adopted_by_reference_bit_for_bit_as_te_loads_them(cpu_mesh: DeviceMesh) -> None:
    adopted, reference = _trained(cpu_mesh), _trained(cpu_mesh)
    incoming = _read_in_place(adopted)
    outcome = load_through(adopted, incoming, registry_of(standin_adopter()), **FSDP)
    assert outcome.adopter == "te_fused_adam_fp32" and outcome.allocated_bytes == 0
    assert outcome.reused_bytes == 8 * 30  # 30 FP32 elements in the local shards, two moments each
    for entry, param in zip(incoming["state"].values(), adopted.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert adopted.state[param][key].to_local().untyped_storage().data_ptr() == entry[key].to_local().untyped_storage().data_ptr()
            assert adopted.state[param][key].placements == param.placements
    load_through(reference, _read_in_place(reference), registry_of(), **FSDP)  # TE's own loader
    assert _same_bits(_locals(adopted), _locals(reference))
    for optimizer in (adopted, reference):  # and the next step
        for param in optimizer.param_groups[0]["params"]:
            param.grad = _dtensor(torch.ones(param.to_local().shape), cpu_mesh)
        optimizer.step()
    assert _same_bits(_locals(adopted), _locals(reference))
    assert _same_bits([p.to_local() for p in adopted.param_groups[0]["params"]], [p.to_local() for p in reference.param_groups[0]["params"]])


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda entry, cpu_mesh: _dtensor(entry.to_local(), cpu_mesh, Replicate()), "parameter 0: exp_avg has another placements than the parameter"),
        (lambda entry, cpu_mesh: entry.to_local(), "parameter 0: exp_avg is a Tensor, the parameter a DTensor"),
        (lambda entry, cpu_mesh: _dtensor(entry.to_local().double(), cpu_mesh), "parameter 0: exp_avg is torch.float64, not torch.float32"),
        (
            lambda entry, cpu_mesh: DTensor.from_local(entry.to_local(), cpu_mesh, [Shard(0)], shape=(24,), stride=(1,)),
            "parameter 0: exp_avg has global shape (24,) and stride (1,), the parameter (12,) and (1,)",
        ),
    ],
    ids=["other placements", "plain tensor for a DTensor parameter", "FP64 local shard", "other global shape"],
)
def test_dtensor_state_laid_out_otherwise_is_declined_by_the_rule_and_te_loads_it(
    cpu_mesh: DeviceMesh, change: Any, reason: str
) -> None:
    optimizer = _trained(cpu_mesh)
    incoming = _read_in_place(optimizer)
    incoming["state"][0] = {**incoming["state"][0], "exp_avg": change(incoming["state"][0]["exp_avg"], cpu_mesh)}
    outcome = load_through(optimizer, incoming, registry_of(standin_adopter()), **FSDP)
    assert outcome.declines == (("te_fused_adam_fp32", reason),)
    assert outcome.adopter is None and outcome.method == "FusedAdamStandIn.load_state_dict"


@pytest.mark.parametrize("without_entry", [False, True], ids=["empty state", "no state entry"])
def test_an_empty_local_shard_is_adopted_as_te_loads_it(cpu_mesh: DeviceMesh, without_entry: bool) -> None:
    """A parameter whose local shard is empty (uneven sharding) has empty moments -- TE's first
    step creates them -- or, in a checkpoint that has none for it, no entry at all; either way
    the loaders give it what the state dict has."""
    optimizer = _trained(cpu_mesh, [(12,), (0,), (6,)])
    incoming = _read_in_place(optimizer)
    assert incoming["state"][1]["exp_avg"].to_local().numel() == 0
    if without_entry:
        del incoming["state"][1]
    outcome = load_through(optimizer, incoming, registry_of(standin_adopter()), **FSDP)
    assert outcome.adopter == "te_fused_adam_fp32" and outcome.allocated_bytes == 0
    assert (optimizer.param_groups[0]["params"][1] in optimizer.state) is not without_entry


def test_the_megatron_fsdp_branch_of_the_installed_distributed_optimizer_adopts_dtensor_state(cpu_mesh: DeviceMesh) -> None:
    adopter = standin_adopter()
    adopter.name = "fsdp_standin"  # our own adopter object, renamed beside the default one
    outcomes: List[StateAdoptionOutcome] = []
    handles = [register_state_adopter(adopter, prepend=True), register_outcome_hook(outcomes.append)]
    try:
        owner = CpuDistributedOptimizer(_trained(cpu_mesh), OptimizerConfig(), FSDP["ddp_config"])
        owner.load_state_dict(_read_in_place(owner.optimizer))
    finally:
        for handle in handles:
            handle.remove()
    assert [(o.adopter, o.allocated_bytes, o.reused_bytes) for o in outcomes] == [("fsdp_standin", 0, 240)]
