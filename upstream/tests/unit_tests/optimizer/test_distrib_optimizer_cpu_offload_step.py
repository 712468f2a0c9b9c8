# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""A dp_reshardable load into the CPU-offloaded distributed optimizer keeps the checkpoint's
Adam step.

With ``optimizer_cpu_offload``, the inner optimizer is a HybridDeviceOptimizer whose torch AdamW
keeps a ``step`` per parameter. The dp_reshardable load template holds the step of the dummy
step that created the state to read into (1), as a non-persistent entry; the checkpoint's step
is set by ``load_state_dict`` from the saved param groups and must survive the parameter-state
load that follows.
"""

import pytest
import torch

from megatron.core.dist_checkpointing import load, save
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import is_torch_min_version
from tests.unit_tests.dist_checkpointing import TempNamedDir, initialize_gpt_model
from tests.unit_tests.test_utilities import Utils

STEPS = 3


def _cpu_offloaded_model_and_optimizer(seed):
    """A small BF16 GPT and its distributed optimizer with every state on the CPU."""
    gpt_model = initialize_gpt_model(seed=seed)
    gpt_model.cuda(torch.cuda.current_device())
    model = DistributedDataParallel(
        gpt_model.config,
        DistributedDataParallelConfig(use_distributed_optimizer=True),
        Float16Module(gpt_model.config, gpt_model),
    )
    config = OptimizerConfig(
        optimizer='adam',
        lr=1e-3,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=1.0,
    )
    optimizer = get_megatron_optimizer(config, [model])
    (distributed_optimizer,) = optimizer.chained_optimizers
    assert isinstance(distributed_optimizer.optimizer, HybridDeviceOptimizer)
    return gpt_model, model, optimizer


def _adam_steps(optimizer):
    (distributed_optimizer,) = optimizer.chained_optimizers
    hybrid = distributed_optimizer.optimizer
    states = [*hybrid.state.values()]
    states += [state for inner in hybrid.sub_optimizers for state in inner.state.values()]
    assert states
    return sorted({int(state['step']) for state in states})


class TestCpuOffloadedAdamStep:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.skipif(
        not is_torch_min_version("2.6a0"), reason="dp_reshardable requires PyTorch 2.6a0 or later"
    )
    def test_dp_reshardable_load_keeps_the_checkpoint_step(self, tmp_path_dist_ckpt):
        metadata = {'distrib_optim_sharding_type': 'dp_reshardable'}
        gpt_model_a, model_a, optimizer_a = _cpu_offloaded_model_and_optimizer(seed=2)
        for _ in range(STEPS):
            for param in model_a.parameters():
                param.main_grad.normal_()
            optimizer_a.step()
        assert _adam_steps(optimizer_a) == [STEPS]

        with TempNamedDir(tmp_path_dist_ckpt / 'test_cpu_offload_adam_step', sync=True) as ckpt_dir:
            save(
                optimizer_a.sharded_state_dict(gpt_model_a.sharded_state_dict(), metadata=metadata),
                ckpt_dir,
            )
            gpt_model_b, _, optimizer_b = _cpu_offloaded_model_and_optimizer(seed=3)
            load_sharded_state_dict = optimizer_b.sharded_state_dict(
                gpt_model_b.sharded_state_dict(), metadata=metadata, is_loading=True
            )
            optimizer_b.load_state_dict(load(load_sharded_state_dict, ckpt_dir))

        # Without the fix, every step is the load template's (1): Adam's bias correction restarts.
        assert _adam_steps(optimizer_b) == [STEPS]
