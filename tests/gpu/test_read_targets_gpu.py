"""The read hook point with real Transformer Engine and a real ``torch_dist`` read.

A precision-aware DistributedOptimizer (the installed class, tests/mcore_owners.py) over a real
TE FusedAdam with BF16 moments and int16 master remainders builds its read targets inside
``reading_optimizer_state``; ``megatron.core.dist_checkpointing.load`` reads an FP32 checkpoint
into them; ``_set_main_param_and_optimizer_states`` stores what was read. With a provider of
the held BF16 moments (the test provider, and the built-in precision-aware adopter) the
read goes straight into the held tensors, allocates no FP32 copies, and the state and the next
TE step are bit for bit those of upstream's path (FP32 copies, TE's ``set_scaled_state``).
"""

import tempfile
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch
import torch.distributed as dist
from adopters_for_tests import ReadTargets
from builders import registry_of
from gpu_requirements import gpu_only
from mcore_owners import precision_aware_owner
from te_optimizers import bitwise_equal, params_of, random_step, state_tensors

from megatron.core.optimizer.state_adoption import (
    StateAdopterRegistry,
    TEFusedAdamPrecisionAwareStateAdopter,
    reading_optimizer_state,
)

pytestmark = gpu_only

SHAPES = [(1 << 20,), (512, 256), (1000,)]


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def _owner() -> Any:
    from transformer_engine.pytorch.optimizers import FusedAdam

    generator = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator, device="cuda").bfloat16()) for s in SHAPES]
    optimizer = FusedAdam(
        params,
        lr=1e-3,
        weight_decay=0.01,
        master_weights=True,
        store_param_remainders=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
    )
    return precision_aware_owner(optimizer)


def _save_checkpoint(directory: str) -> None:
    """A precision-aware checkpoint: FP32 moments, int16 remainders, one tensor per state."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    generator = torch.Generator(device="cuda").manual_seed(3)
    tensors: Dict[str, Any] = {}
    for index, shape in enumerate(SHAPES):
        for key in ("exp_avg", "exp_avg_sq"):
            value = torch.randn(shape, generator=generator, device="cuda") / 5
            tensors[f"{index}.{key}"] = value
        remainders = torch.randint(-(2**15), 2**15 - 1, shape, generator=generator, device="cuda", dtype=torch.int16)
        tensors[f"{index}.param"] = remainders
    sharded = {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in tensors.items()}
    dist_checkpointing.save(sharded, directory)


def _resume(owner: Any, registry: StateAdopterRegistry, directory: str) -> Tuple[List[Dict[str, torch.Tensor]], int]:
    """Build the targets, read the checkpoint into them with megatron-core, store them; returns
    the targets and the CUDA peak of the read over the level before the targets were built."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    params = params_of(owner.optimizer)
    with reading_optimizer_state(owner, True, registry=registry):
        targets = [owner._get_main_param_and_optimizer_states(p) for p in params]
    sharded = {
        f"{i}.{key}": ShardedTensor.from_rank_offsets(f"{i}.{key}", tensor, replica_id=0)
        for i, tensors in enumerate(targets)
        for key, tensor in tensors.items()
    }
    loaded = dist_checkpointing.load(sharded, directory)
    for i, param in enumerate(params):
        owner._set_main_param_and_optimizer_states(param, {key: loaded[f"{i}.{key}"] for key in targets[i]})
    torch.cuda.synchronize()
    return targets, torch.cuda.max_memory_allocated() - before


PROVIDERS: Dict[str, Callable[[], Any]] = {
    "test provider": ReadTargets,
    "precision-aware adopter": TEFusedAdamPrecisionAwareStateAdopter,
}


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_the_checkpoint_is_read_into_the_held_moments_bit_for_bit_as_upstream(process_group: None, provider: str) -> None:
    registry = registry_of(PROVIDERS[provider]())
    with tempfile.TemporaryDirectory() as directory:
        _save_checkpoint(directory)
        upstream, build = _owner(), _owner()
        upstream_targets, upstream_peak = _resume(upstream, registry_of(), directory)
        held = {t.data_ptr() for entry in build.optimizer.state.values() for t in entry.values()}
        build_targets, build_peak = _resume(build, registry, directory)
    assert all(t.dtype == torch.float32 for ts in upstream_targets for k, t in ts.items() if k != "param")
    assert all(t.data_ptr() in held for ts in build_targets for t in ts.values())
    assert bitwise_equal(state_tensors(build.optimizer), state_tensors(upstream.optimizer))
    moments_fp32 = sum(8 * torch.Size(s).numel() for s in SHAPES)  # upstream's FP32 copies
    assert upstream_peak - build_peak >= moments_fp32, (upstream_peak, build_peak)
    random_step(build.optimizer, 1)
    random_step(upstream.optimizer, 1)
    assert bitwise_equal(state_tensors(build.optimizer), state_tensors(upstream.optimizer))
