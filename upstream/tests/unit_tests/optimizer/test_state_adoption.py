# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""Tests for optimizer state adoption (``megatron.core.optimizer.state_adoption``).

``DistributedOptimizer.load_state_dict`` hands the assembled inner state to
``load_inner_optimizer_state_dict``: the first registered adopter that accepts installs it,
otherwise the inner optimizer's own ``load_state_dict`` runs. The registry and fail-safety tests
use ``torch.optim.Adam`` and run anywhere; the Transformer Engine tests need CUDA and TE.
"""

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from megatron.core.dist_checkpointing import load, save
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import param_group_identifier_keys
from megatron.core.optimizer.state_adoption import (
    StateAdoptionContext,
    StateAdoptionOutcome,
    export_inner_optimizer_state_dict,
    load_inner_optimizer_state_dict,
    register_outcome_hook,
    register_state_adopter,
    registered_state_adopters,
)
from tests.unit_tests.dist_checkpointing import TempNamedDir, setup_model_and_optimizer
from tests.unit_tests.test_utilities import Utils

try:
    from transformer_engine.pytorch.optimizers import FusedAdam

    HAVE_TE_FUSED_ADAM = True
except ImportError:
    HAVE_TE_FUSED_ADAM = False

DISABLE_ALL_ENV = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"
DISABLE_BY_NAME_ENV = "MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS"
DEFAULT_ADOPTER = "te_fused_adam_fp32"

requires_te_on_cuda = pytest.mark.skipif(
    not (HAVE_TE_FUSED_ADAM and torch.cuda.is_available()),
    reason="needs CUDA and Transformer Engine's FusedAdam",
)


class RecordingAdopter:
    """A test adopter that records every check and adoption.

    Args:
        name: registry name.
        accept: whether ``decline_reason`` accepts.
        check_error: raised by ``decline_reason`` if set.
        fail_after_partial_install: install the state of one parameter, then raise.
    """

    def __init__(self, name, accept=True, check_error=None, fail_after_partial_install=False):
        self.name = name
        self.accept = accept
        self.check_error = check_error
        self.fail_after_partial_install = fail_after_partial_install
        self.checked = []
        self.adopted = []

    def decline_reason(self, context):
        self.checked.append(context)
        if self.check_error is not None:
            raise self.check_error
        return None if self.accept else f"{self.name} declines in this test"

    def adopt(self, context):
        self.adopted.append(context)
        optimizer = context.optimizer
        if self.fail_after_partial_install:
            param = optimizer.param_groups[0]["params"][0]
            optimizer.state[param] = {"exp_avg": torch.full_like(param, 7.0)}
            optimizer.param_groups[0]["lr"] = 123.0
            raise RuntimeError("adoption failed half-way")
        torch.optim.Optimizer.load_state_dict(optimizer, dict(context.state_dict))
        return 0


@pytest.fixture
def register():
    """Register adopters for one test (first by default); all are removed afterwards."""
    handles = []

    def _register(adopter, prepend=True):
        handles.append(register_state_adopter(adopter, prepend=prepend))
        return handles[-1]

    yield _register
    for handle in reversed(handles):
        handle.remove()


@pytest.fixture
def outcomes():
    """Every outcome reported while the test runs."""
    received = []
    handle = register_outcome_hook(received.append)
    yield received
    handle.remove()


def _trained_adam(seed=0, device="cpu"):
    """A torch Adam whose param group carries the keys DistributedOptimizer matches groups by."""
    generator = torch.Generator(device=device).manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(shape, generator=generator, device=device))
        for shape in ((16,), (4, 8))
    ]
    group = {"params": params, **{key: None for key in param_group_identifier_keys}}
    optimizer = torch.optim.Adam([group], lr=1e-3)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator, device=device)
        optimizer.step()
    return optimizer


def _owner(optimizer, **config_overrides):
    """What ``StateAdoptionContext.for_owner`` reads from a DistributedOptimizer."""
    return SimpleNamespace(
        optimizer=optimizer,
        config=OptimizerConfig(**config_overrides),
        ddp_config=DistributedDataParallelConfig(),
        is_stub_optimizer=False,
    )


def _moments(optimizer):
    return [
        optimizer.state[param][key]
        for group in optimizer.param_groups
        for param in group["params"]
        for key in ("exp_avg", "exp_avg_sq")
    ]


def _bits(tensor):
    """The bytes of ``tensor``, for bitwise comparison."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_same_state(optimizer, reference):
    """Bitwise-equal state entries and equal hyper-parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    reference_params = [p for g in reference.param_groups for p in g["params"]]
    for param, reference_param in zip(params, reference_params):
        state, reference_state = optimizer.state[param], reference.state[reference_param]
        assert sorted(state) == sorted(reference_state)
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == reference_state[key].dtype
                assert torch.equal(_bits(value), _bits(reference_state[key]))
            else:
                assert value == reference_state[key]
    for group, reference_group in zip(optimizer.param_groups, reference.param_groups):
        assert {k: v for k, v in group.items() if k != "params"} == {
            k: v for k, v in reference_group.items() if k != "params"
        }


def _loads(outcomes):
    return [outcome for outcome in outcomes if outcome.hook_point == "load"]


class TestStateAdopterRegistry:
    def test_default_adopter_is_registered(self):
        registrations = {r.name: r for r in registered_state_adopters()}
        assert DEFAULT_ADOPTER in registrations
        default = registrations[DEFAULT_ADOPTER]
        assert default.adopter.name == DEFAULT_ADOPTER
        assert isinstance(default.origin, str) and default.origin
        assert callable(default.handle.remove)

    def test_names_are_unique(self, register):
        register(RecordingAdopter("test_unique"))
        with pytest.raises(ValueError):
            register_state_adopter(RecordingAdopter("test_unique"))
        with pytest.raises(ValueError):
            register_state_adopter(RecordingAdopter(DEFAULT_ADOPTER))

    def test_prepend_and_append_order(self, register):
        register(RecordingAdopter("test_appended"), prepend=False)
        register(RecordingAdopter("test_prepended"), prepend=True)
        names = [r.name for r in registered_state_adopters()]
        assert names[0] == "test_prepended"
        assert names[-1] == "test_appended"
        assert names.index(DEFAULT_ADOPTER) < names.index("test_appended")

    def test_handle_removes_and_frees_the_name(self, register):
        handle = register_state_adopter(RecordingAdopter("test_removable"))
        handle.remove()
        assert "test_removable" not in [r.name for r in registered_state_adopters()]
        register(RecordingAdopter("test_removable"))
        assert "test_removable" in [r.name for r in registered_state_adopters()]

    def test_first_accepting_adopter_wins(self, register, outcomes):
        declining = RecordingAdopter("test_declining", accept=False)
        first = RecordingAdopter("test_first")
        second = RecordingAdopter("test_second")
        for adopter in (second, first, declining):
            register(adopter)
        optimizer, source = _trained_adam(0), _trained_adam(1)

        outcome = load_inner_optimizer_state_dict(_owner(optimizer), source.state_dict())

        assert isinstance(outcome, StateAdoptionOutcome)
        assert outcome.hook_point == "load"
        assert outcome.optimizer == "Adam"
        assert outcome.adopter == "test_first"
        assert outcome.avoided_bytes == 0
        assert ("test_declining", "test_declining declines in this test") in outcome.declines
        assert len(first.adopted) == 1 and second.checked == []
        assert _loads(outcomes) == [outcome]
        assert json.loads(json.dumps(outcome.to_json()))["adopter"] == "test_first"
        _assert_same_state(optimizer, source)

    def test_context_describes_the_owner(self, register):
        adopter = RecordingAdopter("test_context")
        register(adopter)
        optimizer = _trained_adam(0)
        owner = _owner(optimizer)
        state_dict = _trained_adam(1).state_dict()

        load_inner_optimizer_state_dict(owner, state_dict)

        context = adopter.checked[0]
        assert isinstance(context, StateAdoptionContext)
        assert context.optimizer is optimizer
        assert context.config is owner.config and context.ddp_config is owner.ddp_config
        assert context.is_stub_optimizer is False
        assert sorted(context.state_dict) == ["param_groups", "state"]

    @pytest.mark.parametrize("disabled", ["test_first", "test_other,test_first"])
    def test_disable_by_name(self, register, monkeypatch, disabled):
        first, second = RecordingAdopter("test_first"), RecordingAdopter("test_second")
        register(second)
        register(first)
        monkeypatch.setenv(DISABLE_BY_NAME_ENV, disabled)
        optimizer = _trained_adam(0)

        outcome = load_inner_optimizer_state_dict(_owner(optimizer), _trained_adam(1).state_dict())

        assert first.checked == [] and first.adopted == []
        assert outcome.adopter == "test_second"

    def test_kill_switch_runs_the_optimizers_own_loader(self, register, monkeypatch):
        adopter = RecordingAdopter("test_accepting")
        register(adopter)
        monkeypatch.setenv(DISABLE_ALL_ENV, "1")
        optimizer, source = _trained_adam(0), _trained_adam(1)

        outcome = load_inner_optimizer_state_dict(_owner(optimizer), source.state_dict())

        assert adopter.checked == [] and adopter.adopted == []
        assert outcome.adopter is None and outcome.avoided_bytes == 0
        _assert_same_state(optimizer, source)

    def test_outcome_hooks_run_in_order_until_removed(self):
        calls = []
        last = register_outcome_hook(lambda outcome: calls.append(("last", outcome)))
        first = register_outcome_hook(
            lambda outcome: calls.append(("first", outcome)), prepend=True
        )
        try:
            outcome = load_inner_optimizer_state_dict(
                _owner(_trained_adam(0)), _trained_adam(1).state_dict()
            )
        finally:
            first.remove()
            last.remove()
        loads = [(name, o) for name, o in calls if o.hook_point == "load"]
        assert [name for name, _ in loads] == ["first", "last"]
        assert all(o is outcome or o == outcome for _, o in loads)

        calls.clear()
        load_inner_optimizer_state_dict(_owner(_trained_adam(0)), _trained_adam(1).state_dict())
        assert calls == []

    def test_no_adopter_accepts_for_torch_adam(self, outcomes):
        optimizer, source = _trained_adam(0), _trained_adam(1)

        outcome = load_inner_optimizer_state_dict(_owner(optimizer), source.state_dict())

        assert outcome.adopter is None and outcome.avoided_bytes == 0
        assert DEFAULT_ADOPTER in [name for name, _ in outcome.declines]
        _assert_same_state(optimizer, source)

    def test_instance_load_state_dict_runs_once_when_nothing_adopts(self):
        optimizer, source = _trained_adam(0), _trained_adam(1)
        calls = []
        own_loader = optimizer.load_state_dict

        def instance_loader(state_dict):
            calls.append(state_dict)
            return own_loader(state_dict)

        optimizer.load_state_dict = instance_loader

        outcome = load_inner_optimizer_state_dict(_owner(optimizer), source.state_dict())

        assert outcome.adopter is None
        assert len(calls) == 1
        _assert_same_state(optimizer, source)


class TestStateAdoptionFailSafety:
    def test_raising_check_is_a_decline(self, register):
        raising = RecordingAdopter("test_raising_check", check_error=KeyError("boom"))
        accepting = RecordingAdopter("test_accepting")
        register(accepting)
        register(raising)
        optimizer, source = _trained_adam(0), _trained_adam(1)

        outcome = load_inner_optimizer_state_dict(_owner(optimizer), source.state_dict())

        assert "test_raising_check" in [name for name, _ in outcome.declines]
        assert raising.adopted == []
        assert outcome.adopter == "test_accepting"
        _assert_same_state(optimizer, source)

    def test_raising_adoption_is_rolled_back_and_own_loader_runs(self, register):
        failing = RecordingAdopter("test_failing", fail_after_partial_install=True)
        register(failing)
        optimizer, source = _trained_adam(0), _trained_adam(1)
        reference = _trained_adam(0)
        state_dict = source.state_dict()
        reference.load_state_dict(copy.deepcopy(state_dict))
        incoming_moments = [
            entry[key]
            for entry in state_dict["state"].values()
            for key in ("exp_avg", "exp_avg_sq")
        ]
        incoming_copies = [tensor.clone() for tensor in incoming_moments]

        outcome = load_inner_optimizer_state_dict(_owner(optimizer), state_dict)

        assert len(failing.adopted) == 1
        assert outcome.adopter is None and outcome.avoided_bytes == 0
        assert outcome.fallback_reason
        _assert_same_state(optimizer, reference)
        for tensor, copy_ in zip(incoming_moments, incoming_copies):
            assert torch.equal(tensor, copy_)


def _bare_distributed_optimizer(inner):
    """A DistributedOptimizer with what load_state_dict reads once the inner state exists."""
    optimizer = object.__new__(DistributedOptimizer)
    optimizer.optimizer = inner
    optimizer.config = OptimizerConfig()
    optimizer.ddp_config = DistributedDataParallelConfig()
    optimizer.grad_scaler = None
    optimizer.is_stub_optimizer = False
    return optimizer


def _outer_state_dict(inner):
    """The non-tensor state dict DistributedOptimizer.load_state_dict receives for ``inner``."""
    groups = [
        {k: v for k, v in group.items() if k != "params"}
        for group in inner.state_dict()["param_groups"]
    ]
    for group in groups:
        group["step"] = 2
    return {"optimizer": {"param_groups": groups}}


class TestDistributedOptimizerCallSite:
    """``DistributedOptimizer.load_state_dict`` goes through the registry (second load pass)."""

    def test_load_state_dict_consults_the_registry(self, register, outcomes):
        adopter = RecordingAdopter("test_accepting")
        register(adopter)
        distributed = _bare_distributed_optimizer(_trained_adam(0))
        moments = _moments(distributed.optimizer)

        distributed.load_state_dict(_outer_state_dict(distributed.optimizer))

        assert len(adopter.adopted) == 1
        assert adopter.adopted[0].optimizer is distributed.optimizer
        assert adopter.adopted[0].config is distributed.config
        assert [o.adopter for o in _loads(outcomes)] == ["test_accepting"]
        assert all(o.hook_point in ("load", "export") for o in outcomes)
        assert all(a is b for a, b in zip(_moments(distributed.optimizer), moments))

    def test_megatron_fsdp_path_is_unchanged(self, register, outcomes):
        adopter = RecordingAdopter("test_accepting")
        register(adopter)
        distributed = _bare_distributed_optimizer(_trained_adam(0))
        distributed.ddp_config.use_megatron_fsdp = True
        source = _trained_adam(1)

        distributed.load_state_dict(source.state_dict())

        assert adopter.checked == [] and outcomes == []
        _assert_same_state(distributed.optimizer, source)


def _te_fused_adam(seed, **kwargs):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(shape, generator=generator, device="cuda"))
        for shape in ((1024,), (64, 32))
    ]
    return FusedAdam(params, lr=1e-3, **kwargs), generator


def _trained_te_fused_adam(seed, **kwargs):
    optimizer, generator = _te_fused_adam(seed, **kwargs)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator, device="cuda")
        optimizer.step()
    return optimizer


def _independent_copy(state_dict):
    """The state dict with every state tensor cloned (no tensor shared with its optimizer)."""
    result = copy.copy(state_dict)
    result["state"] = {
        key: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for key, entry in state_dict["state"].items()
    }
    result["param_groups"] = copy.deepcopy(state_dict["param_groups"])
    return result


def _step_with_same_grads(optimizers, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    grads = None
    for optimizer in optimizers:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if grads is None:
            grads = [torch.randn(p.shape, generator=generator, device="cuda") for p in params]
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        optimizer.step()


@requires_te_on_cuda
class TestTEFusedAdamFP32Adopter:
    def test_fp32_moments_are_installed_by_reference(self, outcomes, monkeypatch):
        source = _trained_te_fused_adam(seed=1)
        incoming = _independent_copy(source.state_dict())
        target, _ = _te_fused_adam(seed=0)
        reference, _ = _te_fused_adam(seed=0)

        outcome = load_inner_optimizer_state_dict(_owner(target), incoming)

        params = [p for g in target.param_groups for p in g["params"]]
        assert outcome.adopter == DEFAULT_ADOPTER
        assert outcome.avoided_bytes == sum(8 * p.numel() for p in params)
        for index, param in enumerate(params):
            for key in ("exp_avg", "exp_avg_sq"):
                assert target.state[param][key] is incoming["state"][index][key]

        monkeypatch.setenv(DISABLE_ALL_ENV, "1")
        assert (
            load_inner_optimizer_state_dict(
                _owner(reference), _independent_copy(source.state_dict())
            ).adopter
            is None
        )
        _assert_same_state(target, reference)
        _step_with_same_grads([target, reference], seed=5)
        _assert_same_state(target, reference)
        for param, reference_param in zip(
            params, [p for g in reference.param_groups for p in g["params"]]
        ):
            assert torch.equal(param, reference_param)

    def test_export_matches_fused_adam_state_dict(self):
        optimizer = _trained_te_fused_adam(seed=1)
        expected = optimizer.state_dict()

        exported = export_inner_optimizer_state_dict(_owner(optimizer))

        assert exported["param_groups"] == expected["param_groups"]
        assert sorted(exported["state"]) == sorted(expected["state"])
        for key, entry in expected["state"].items():
            assert sorted(exported["state"][key]) == sorted(entry)
            for name, value in entry.items():
                assert torch.equal(exported["state"][key][name], value)

    def test_bf16_moments_keep_te_loader(self):
        source = _trained_te_fused_adam(seed=1, exp_avg_dtype=torch.bfloat16)
        target, _ = _te_fused_adam(seed=0, exp_avg_dtype=torch.bfloat16)
        reference, _ = _te_fused_adam(seed=0, exp_avg_dtype=torch.bfloat16)
        reference.load_state_dict(_independent_copy(source.state_dict()))

        outcome = load_inner_optimizer_state_dict(
            _owner(target), _independent_copy(source.state_dict())
        )

        assert outcome.adopter is None
        assert DEFAULT_ADOPTER in [name for name, _ in outcome.declines]
        _assert_same_state(target, reference)

    def test_instance_level_load_state_dict_is_respected(self):
        source = _trained_te_fused_adam(seed=1)
        target, _ = _te_fused_adam(seed=0)
        calls = []
        own_loader = target.load_state_dict

        def instance_loader(state_dict):
            calls.append(state_dict)
            return own_loader(state_dict)

        target.load_state_dict = instance_loader

        outcome = load_inner_optimizer_state_dict(
            _owner(target), _independent_copy(source.state_dict())
        )

        assert outcome.adopter != DEFAULT_ADOPTER
        assert len(calls) == 1


@requires_te_on_cuda
class TestDistributedOptimizerCheckpointAdoption:
    def setup_method(self, method):
        pass

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @staticmethod
    def _fill_state(optimizer, seed):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        for distributed in optimizer.chained_optimizers:
            inner = distributed.optimizer
            for group in inner.param_groups:
                for param in group["params"]:
                    for key in ("exp_avg", "exp_avg_sq"):
                        inner.state[param][key] = torch.rand(
                            param.shape, generator=generator, device="cuda"
                        )

    @staticmethod
    def _inner_tensors(optimizer):
        tensors = []
        for distributed in optimizer.chained_optimizers:
            inner = distributed.optimizer
            for group in inner.param_groups:
                for param in group["params"]:
                    tensors.append(param)
                    tensors.extend(inner.state[param][k] for k in ("exp_avg", "exp_avg_sq"))
        return tensors

    # fully_sharded_model_space is left out: saving it raises "ShardedTensor.flattened_range is
    # not supported" on this code base, with or without this change (seen on the H200).
    @pytest.mark.parametrize("sharding_type", ["dp_reshardable", "fully_reshardable"])
    def test_resume_adopts_state_bitwise_equal(self, tmp_path_dist_ckpt, outcomes, sharding_type):
        Utils.initialize_model_parallel(1, 1)
        metadata = {"distrib_optim_sharding_type": sharding_type}
        with TempNamedDir(
            tmp_path_dist_ckpt / f"test_state_adoption_{sharding_type}", sync=True
        ) as ckpt_dir:
            model_A, optimizer_A = setup_model_and_optimizer(seed=2, tp=1, pp=1)
            if not all(isinstance(d.optimizer, FusedAdam) for d in optimizer_A.chained_optimizers):
                pytest.skip("the distributed optimizer does not use TE's FusedAdam")
            self._fill_state(optimizer_A, seed=100 + Utils.rank)
            save(
                optimizer_A.sharded_state_dict(model_A[0].sharded_state_dict(), metadata=metadata),
                ckpt_dir,
            )

            model_B, optimizer_B = setup_model_and_optimizer(seed=3, tp=1, pp=1)
            self._fill_state(optimizer_B, seed=200 + Utils.rank)
            outcomes.clear()
            load_template = optimizer_B.sharded_state_dict(
                model_B[0].sharded_state_dict(), is_loading=True, metadata=metadata
            )
            optimizer_B.load_state_dict(load(load_template, ckpt_dir))

            loads = _loads(outcomes)
            assert loads, "DistributedOptimizer.load_state_dict reported no load outcome"
            for outcome in loads:
                assert outcome.optimizer == "FusedAdam"
                assert outcome.adopter == DEFAULT_ADOPTER, outcome.to_json()
            expected_bytes = {
                sum(8 * p.numel() for g in d.optimizer.param_groups for p in g["params"])
                for d in optimizer_B.chained_optimizers
            }
            assert {outcome.avoided_bytes for outcome in loads} <= expected_bytes

            for tensor_A, tensor_B in zip(
                self._inner_tensors(optimizer_A), self._inner_tensors(optimizer_B)
            ):
                assert tensor_A.dtype == tensor_B.dtype == torch.float32
                assert torch.equal(tensor_A.view(torch.int32), tensor_B.view(torch.int32))
        Utils.destroy_model_parallel()
