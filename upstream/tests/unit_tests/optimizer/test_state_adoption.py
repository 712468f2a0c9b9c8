# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""Tests for optimizer state adoption: the registry, the load dispatcher, the TE FusedAdam FP32
adopter and the DistributedOptimizer load call sites.

The registry and dispatcher tests use ``torch.optim.Adam`` on CPU with isolated, strict
registries (every fallback raises); the Transformer Engine tests need CUDA and TE.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron.core.dist_checkpointing import load, save
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import param_group_identifier_keys
from megatron.core.optimizer.state_adoption import (
    StateAdopter,
    StateAdopterRegistry,
    default_registry,
    load_inner_optimizer_state_dict,
)

try:
    from transformer_engine.pytorch.optimizers import FusedAdam

    HAVE_TE_FUSED_ADAM = True
except ImportError:
    HAVE_TE_FUSED_ADAM = False

requires_te_on_cuda = pytest.mark.skipif(
    not (HAVE_TE_FUSED_ADAM and torch.cuda.is_available()),
    reason="needs CUDA and Transformer Engine's FusedAdam",
)


class PyTorchLoaderAdopter(StateAdopter):
    """Installs with PyTorch's own loader (which keeps tensors of the parameters' dtype)."""

    def __init__(self, name, accept=True, install=None):
        self._name, self.accept, self.install = name, accept, install
        self.checked = 0

    @property
    def name(self):
        return self._name

    def decline_reason(self, context):
        self.checked += 1
        return None if self.accept else "declines in this test"

    def adopt(self, context):
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
        if self.install is not None:
            self.install(context.optimizer)


def _trained_adam(seed=0, device="cpu"):
    generator = torch.Generator(device=device).manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=generator, device=device)) for s in (16, 8)
    ]
    group = {"params": params, **{key: None for key in param_group_identifier_keys}}
    optimizer = torch.optim.Adam([group], lr=1e-3)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator, device=device)
        optimizer.step()
    return optimizer


def _owner(optimizer, **config):
    return SimpleNamespace(
        optimizer=optimizer,
        config=OptimizerConfig(**config),
        ddp_config=DistributedDataParallelConfig(),
        is_stub_optimizer=False,
    )


def _cloned(state_dict):
    state = {k: {n: v.clone() for n, v in e.items()} for k, e in state_dict["state"].items()}
    return {"state": state, "param_groups": [dict(g) for g in state_dict["param_groups"]]}


def _moments(optimizer):
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [optimizer.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]


def _load(owner, state_dict, registry, owns_state_dict=True):
    outcomes = []
    handle = registry.register_outcome_hook(outcomes.append)
    try:
        load_inner_optimizer_state_dict(
            owner, state_dict, owns_state_dict=owns_state_dict, registry=registry
        )
    finally:
        handle.remove()
    (outcome,) = outcomes
    return outcome


class TestStateAdopterRegistry:
    def test_built_in_adopters_are_registered(self):
        names = [adopter.name for adopter in default_registry().adopters()]
        assert names[0] == "te_fused_adam_fp32"

    def test_order_prepend_and_handles(self):
        registry = StateAdopterRegistry(strict=True)
        a, b, c = (PyTorchLoaderAdopter(name) for name in "abc")
        handle_a = registry.register(a)
        registry.register(b)
        registry.register(c, prepend=True)
        assert registry.adopters() == (c, a, b)
        handle_a.remove()
        handle_a.remove()
        assert registry.adopters() == (c, b)
        registry.register(PyTorchLoaderAdopter("a"))  # the name is free again

    @pytest.mark.parametrize("name", ["", "1st", "a b", None])
    def test_names_must_be_well_formed_and_unique(self, name):
        registry = StateAdopterRegistry()
        with pytest.raises(TypeError):
            registry.register(PyTorchLoaderAdopter(name))
        registry.register(PyTorchLoaderAdopter("x"))
        with pytest.raises(ValueError):
            registry.register(PyTorchLoaderAdopter("x"))
        with pytest.raises(TypeError):
            registry.register(object())


class TestLoadDispatcher:
    def test_first_accepting_adopter_installs_by_reference(self):
        declining, accepting = PyTorchLoaderAdopter("no", accept=False), PyTorchLoaderAdopter("yes")
        registry = StateAdopterRegistry(strict=True)
        registry.register(declining)
        registry.register(accepting)
        target, incoming = _trained_adam(seed=0), _cloned(_trained_adam(seed=1).state_dict())

        outcome = _load(_owner(target), incoming, registry)

        assert (outcome.adopter, outcome.declines) == ("yes", (("no", "declines in this test"),))
        given = [incoming["state"][i][k] for i in (0, 1) for k in ("exp_avg", "exp_avg_sq")]
        assert all(a is b for a, b in zip(_moments(target), given))
        tensors = [t for entry in incoming["state"].values() for t in entry.values()]
        assert outcome.allocated_bytes == 0 and outcome.reused_bytes == sum(
            t.nbytes for t in tensors
        )

    def test_switched_off_runs_the_own_loader_and_nothing_else(self):
        adopter = PyTorchLoaderAdopter("yes")
        registry = StateAdopterRegistry(strict=True)
        registry.register(adopter)
        outcomes = []
        registry.register_outcome_hook(outcomes.append)
        target, reference = _trained_adam(seed=0), _trained_adam(seed=0)
        incoming = _trained_adam(seed=1).state_dict()

        owner = _owner(target, optimizer_state_adoption=False)
        load_inner_optimizer_state_dict(owner, incoming, registry=registry)
        reference.load_state_dict(incoming)

        assert adopter.checked == 0 and outcomes == []
        for mine, theirs in zip(_moments(target), _moments(reference)):
            assert torch.equal(mine, theirs)

    @pytest.mark.parametrize(
        "install",
        [
            lambda o: o.state[o.param_groups[0]["params"][0]].update(exp_avg=torch.zeros(16)),
            lambda o: o.state[o.param_groups[0]["params"][1]].update(
                exp_avg=o.state[o.param_groups[0]["params"][1]]["exp_avg"].bfloat16()
            ),
            lambda o: o.defaults.update(lr=123.0) or 1 / 0,
        ],
        ids=["zeros instead of the checkpoint", "a BF16 copy", "raises after a change"],
    )
    def test_a_wrong_install_is_undone_and_the_own_loader_runs(self, install):
        registry = StateAdopterRegistry(strict=False)
        registry.register(PyTorchLoaderAdopter("wrong", install=install))
        target, reference = _trained_adam(seed=0), _trained_adam(seed=0)
        incoming = _cloned(_trained_adam(seed=1).state_dict())

        outcome = _load(_owner(target), incoming, registry)
        reference.load_state_dict(_cloned(incoming))

        assert outcome.adopter is None and outcome.method == "Adam.load_state_dict"
        assert outcome.fallback_reason == "adopter 'wrong' failed and was undone"
        assert target.defaults == reference.defaults
        for mine, theirs in zip(_moments(target), _moments(reference)):
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)

    def test_a_write_into_the_checkpoint_cannot_be_undone_and_raises(self):
        registry = StateAdopterRegistry(strict=False)
        write = lambda o: o.state[o.param_groups[0]["params"][0]]["exp_avg"].mul_(2)
        registry.register(PyTorchLoaderAdopter("writing", install=write))
        with pytest.raises(RuntimeError, match="cannot undo this: it wrote into 1 tensor"):
            _load(
                _owner(_trained_adam(seed=0)), _cloned(_trained_adam(seed=1).state_dict()), registry
            )

    def test_the_built_in_adopter_declines_torch_adam(self):
        target, incoming = _trained_adam(seed=0), _cloned(_trained_adam(seed=1).state_dict())
        outcome = _load(_owner(target), incoming, default_registry())
        assert outcome.adopter is None and "te_fused_adam_fp32" in dict(outcome.declines)


def _te_fused_adam(seed, steps=0, **settings):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=generator, device="cuda")) for s in (256, 64)
    ]
    group = {"params": params, **{key: None for key in param_group_identifier_keys}}
    optimizer = FusedAdam([group], lr=1e-3, **settings)
    for step in range(steps):
        for param in params:
            param.grad = torch.full_like(param, 0.1 * (step + 1))
        optimizer.step()
    return optimizer


@requires_te_on_cuda
class TestTEFusedAdamFP32Adopter:
    def test_fp32_moments_are_installed_by_reference_and_train_bitwise_equal(self):
        incoming = _cloned(_te_fused_adam(seed=1, steps=2).state_dict())
        target, reference = _te_fused_adam(seed=0), _te_fused_adam(seed=0)

        outcome = _load(_owner(target), incoming, default_registry())
        reference.load_state_dict(_cloned(incoming))

        given = [incoming["state"][i][k] for i in (0, 1) for k in ("exp_avg", "exp_avg_sq")]
        assert outcome.adopter == "te_fused_adam_fp32" and outcome.allocated_bytes == 0
        assert all(a is b for a, b in zip(_moments(target), given))
        for optimizer in (target, reference):
            for param in (p for g in optimizer.param_groups for p in g["params"]):
                param.grad = torch.full_like(param, -0.25)
            optimizer.step()
        for mine, theirs in zip(_moments(target), _moments(reference)):
            assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32))

    @pytest.mark.parametrize(
        "settings, owns, reason",
        [
            ({}, False, "the caller's tensor"),
            (dict(exp_avg_dtype=torch.bfloat16), True, "not torch.float32"),
            (dict(master_weights=True), True, "FusedAdam.master_weights is set"),
        ],
    )
    def test_other_cases_keep_te_loader(self, settings, owns, reason):
        incoming = _te_fused_adam(seed=1, steps=2, **settings).state_dict()
        target = _te_fused_adam(seed=0, **settings)
        outcome = _load(_owner(target), incoming, default_registry(), owns_state_dict=owns)
        assert outcome.adopter is None and outcome.method == "FusedAdam.load_state_dict"
        assert reason in dict(outcome.declines)["te_fused_adam_fp32"]


@requires_te_on_cuda
@pytest.mark.parametrize("sharding_type", ["dp_reshardable", "fully_reshardable"])
def test_distributed_optimizer_resume_adopts_bitwise_equal(tmp_path_dist_ckpt, sharding_type):
    from tests.unit_tests.dist_checkpointing import TempNamedDir, setup_model_and_optimizer
    from tests.unit_tests.test_utilities import Utils

    Utils.initialize_model_parallel(1, 1)
    metadata = {"distrib_optim_sharding_type": sharding_type}
    outcomes = []
    handle = default_registry().register_outcome_hook(outcomes.append)
    try:
        with TempNamedDir(tmp_path_dist_ckpt / f"state_adoption_{sharding_type}", sync=True) as d:
            model_a, optimizer_a = setup_model_and_optimizer(seed=2, tp=1, pp=1)
            inner = [chained.optimizer for chained in optimizer_a.chained_optimizers]
            if not all(isinstance(optimizer, FusedAdam) for optimizer in inner):
                pytest.skip("the distributed optimizer does not use TE's FusedAdam")
            for optimizer in inner:
                for param in (p for g in optimizer.param_groups for p in g["params"]):
                    for key in ("exp_avg", "exp_avg_sq"):
                        optimizer.state[param][key] = torch.rand_like(param)
            save(
                optimizer_a.sharded_state_dict(model_a[0].sharded_state_dict(), metadata=metadata),
                d,
            )
            model_b, optimizer_b = setup_model_and_optimizer(seed=3, tp=1, pp=1)
            outcomes.clear()
            template = optimizer_b.sharded_state_dict(
                model_b[0].sharded_state_dict(), is_loading=True, metadata=metadata
            )
            optimizer_b.load_state_dict(load(template, d))
    finally:
        handle.remove()
        Utils.destroy_model_parallel()
    loads = [outcome for outcome in outcomes if outcome.hook_point == "load"]
    assert loads and all(o.adopter == "te_fused_adam_fp32" for o in loads), outcomes
    assert all(o.allocated_bytes == 0 for o in loads), outcomes
    for a, b in zip(optimizer_a.chained_optimizers, optimizer_b.chained_optimizers):
        for mine, theirs in zip(_moments(a.optimizer), _moments(b.optimizer)):
            assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32))
