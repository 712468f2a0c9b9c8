"""Megatron-FSDP's DTensor state with real Transformer Engine FusedAdam.

What the CPU stand-in claims about TE 2.x, checked against TE itself on DTensors of a one-rank
device mesh: TE's own loader copies DTensor moments (8 B x local elements), the default adopter
installs them by reference with bit-for-bit TE's result and next step, and TE's ``step()``
without gradients, on the state the default adopter creates in one allocation, gives exactly the
state and group ``step`` of MCore's dummy step on zero gradients (the ``initialize`` hook point).
"""

from typing import Any, Iterator, List

import pytest
import torch
import torch.distributed as dist
from builders import Owner, ddp_config_with, load_through, outcome_of, registry_of
from gpu_requirements import gpu_only
from te_optimizers import bitwise_equal

from megatron.core.optimizer.state_adoption import (
    StateAdopterRegistry,
    initialize_inner_optimizer_state,
)
from megatron.core.optimizer.state_adoption.te_fused_adam import TEFusedAdamFP32StateAdopter

pytestmark = gpu_only

SHAPES = [(4096,), (256, 64), (1000,)]
ELEMENTS = 4096 + 256 * 64 + 1000


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cuda", (1,))
    if created:
        dist.destroy_process_group()


def _dtensor(local: torch.Tensor, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)


def _fused_adam(mesh: Any) -> torch.optim.Optimizer:
    from transformer_engine.pytorch.optimizers import FusedAdam

    generator = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(_dtensor(torch.randn(s, generator=generator, device="cuda"), mesh)) for s in SHAPES]
    return FusedAdam(params, lr=1e-3, weight_decay=0.01)


def _step(optimizer: torch.optim.Optimizer, mesh: Any, seed: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(100 + seed)
    for param in optimizer.param_groups[0]["params"]:
        param.grad = _dtensor(torch.randn(param.to_local().shape, generator=generator, device="cuda"), mesh)
    optimizer.step()


def _locals(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [optimizer.state[p][k].to_local() for p in optimizer.param_groups[0]["params"] for k in ("exp_avg", "exp_avg_sq")]


def _registry() -> StateAdopterRegistry:
    return registry_of(TEFusedAdamFP32StateAdopter())


def _fsdp_owner(optimizer: torch.optim.Optimizer) -> Owner:
    return Owner(optimizer, ddp_config=ddp_config_with(use_megatron_fsdp=True))


def test_te_copies_dtensor_moments_and_the_adopter_installs_them_by_reference(mesh: Any) -> None:
    adopted, own = _fused_adam(mesh), _fused_adam(mesh)
    for optimizer in (adopted, own):
        for seed in range(2):
            _step(optimizer, mesh, seed)
    fsdp = ddp_config_with(use_megatron_fsdp=True)
    own_outcome = load_through(own, torch.optim.Optimizer.state_dict(own), registry_of(), False, ddp_config=fsdp)
    assert own_outcome.allocated_bytes == 8 * ELEMENTS and own_outcome.reused_bytes == 0  # TE copied
    incoming = torch.optim.Optimizer.state_dict(adopted)
    outcome = load_through(adopted, incoming, _registry(), False, ddp_config=fsdp)
    assert outcome.adopter == "te_fused_adam_fp32" and outcome.allocated_bytes == 0
    assert outcome.reused_bytes == 8 * ELEMENTS
    assert bitwise_equal(_locals(adopted), _locals(own))
    for optimizer in (adopted, own):
        _step(optimizer, mesh, 7)
    assert bitwise_equal(_locals(adopted), _locals(own))
    assert bitwise_equal(
        [p.to_local() for p in adopted.param_groups[0]["params"]], [p.to_local() for p in own.param_groups[0]["params"]]
    )


def test_te_step_without_gradients_creates_the_dummy_steps_state(mesh: Any) -> None:
    ours, dummy = _fused_adam(mesh), _fused_adam(mesh)

    def dummy_step() -> None:  # MCore's _init_optimizer_states_with_dummy_values
        for param in dummy.param_groups[0]["params"]:
            param.grad = torch.zeros_like(param)
        dummy.step()
        dummy.zero_grad()

    registry = _registry()
    outcome = outcome_of(
        registry, lambda: initialize_inner_optimizer_state(_fsdp_owner(ours), lambda: None, registry=registry, steps=True)
    )
    assert outcome.adopter == "te_fused_adam_fp32" and outcome.allocated_bytes == 8 * ELEMENTS
    dummy_step()
    assert all(p.grad is None for p in ours.param_groups[0]["params"])
    assert [sorted(ours.state[p]) for p in ours.param_groups[0]["params"]] == [
        sorted(dummy.state[p]) for p in dummy.param_groups[0]["params"]
    ]
    assert bitwise_equal(_locals(ours), _locals(dummy))
    for mine, theirs in zip(ours.param_groups[0]["params"], dummy.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert ours.state[mine][key].placements == dummy.state[theirs][key].placements == mine.placements
    assert ours.param_groups[0]["step"] == dummy.param_groups[0]["step"] == 1
    storages = {m.untyped_storage().data_ptr() for m in _locals(ours)}
    assert len(storages) == 1  # the moments are views of one allocation
