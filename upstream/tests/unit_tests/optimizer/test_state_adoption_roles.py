# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""Tests for the state adopters' other roles and call sites: plugins, the export, Megatron-FSDP's
initialization, the non-distributed optimizers and the precision-aware adopter."""

import argparse
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
from megatron.core.optimizer.state_adoption import (
    StateAdopterRegistry,
    default_registry,
    export_inner_optimizer_state_dict,
    initialize_inner_optimizer_state,
)
from tests.unit_tests.optimizer.test_state_adoption import (
    PyTorchLoaderAdopter,
    _cloned,
    _load,
    _moments,
    _owner,
    _te_fused_adam,
    _trained_adam,
    requires_te_on_cuda,
)

PLUGIN_GROUP = "test.megatron_core.optimizer_state_adopters"


@pytest.fixture
def register(monkeypatch):
    """Register adopters first in the strict process-wide registry, for one test."""
    monkeypatch.setattr(default_registry(), "strict", True)
    handles = []
    yield lambda adopter: handles.append(default_registry().register(adopter, prepend=True))
    for handle in reversed(handles):
        handle.remove()


@pytest.fixture
def outcomes():
    """Every outcome the process-wide registry reports while the test runs."""
    received = []
    handle = default_registry().register_outcome_hook(received.append)
    yield received
    handle.remove()


def _install_plugins(tmp_path, monkeypatch, entry_points):
    (tmp_path / "adoption_plugins.py").write_text(textwrap.dedent("""
        from tests.unit_tests.optimizer.test_state_adoption import PyTorchLoaderAdopter
        alpha, beta = (lambda: PyTorchLoaderAdopter("alpha")), (lambda: PyTorchLoaderAdopter("beta"))
        def broken():
            raise ImportError("broken in this test")
        """))
    dist_info = tmp_path / "adoption_plugins-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: adoption-plugins\nVersion: 1.0\n"
    )
    lines = "".join(f"{name} = adoption_plugins:{value}\n" for name, value in entry_points.items())
    (dist_info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n{lines}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "adoption_plugins", raising=False)


class TestPlugins:
    def test_plugins_load_lazily_once_in_entry_point_name_order(self, tmp_path, monkeypatch):
        _install_plugins(tmp_path, monkeypatch, {"beta": "beta", "alpha": "alpha"})
        registry = StateAdopterRegistry(strict=True, plugin_group=PLUGIN_GROUP)
        registry.register(PyTorchLoaderAdopter("code"))
        assert [a.name for a in registry.adopters()] == ["code", "alpha", "beta"]
        assert [a.name for a in registry.adopters()] == ["code", "alpha", "beta"]

    def test_a_broken_plugin_never_keeps_the_others_out(self, tmp_path, monkeypatch):
        _install_plugins(tmp_path, monkeypatch, {"a": "broken", "b": "alpha", "c": "beta"})
        strict = StateAdopterRegistry(strict=True, plugin_group=PLUGIN_GROUP)
        with pytest.raises(RuntimeError, match="broken in this test"):
            strict.load_plugins()
        assert [a.name for a in strict.adopters()] == ["alpha", "beta"]


class ExportingAdopter(PyTorchLoaderAdopter):
    def __init__(self, name, export):
        super().__init__(name)
        self.export = export

    def export_decline_reason(self, context):
        return None

    def export_state_dict(self, context):
        return self.export(context.optimizer)


class TestExport:
    @pytest.mark.parametrize(
        "export, adopter",
        [
            (torch.optim.Optimizer.state_dict, "exporter"),
            (lambda o: _cloned(torch.optim.Optimizer.state_dict(o)), None),
        ],
        ids=["the held tensors", "copies"],
    )
    def test_an_export_must_be_the_held_state_itself(self, export, adopter):
        registry = StateAdopterRegistry(strict=False)
        registry.register(ExportingAdopter("exporter", export))
        optimizer, outcomes = _trained_adam(0), []
        registry.register_outcome_hook(outcomes.append)
        exported = export_inner_optimizer_state_dict(_owner(optimizer), registry=registry)
        assert [o.adopter for o in outcomes] == [adopter]  # copies: Adam's own state_dict()
        held = [exported["state"][i][k] for i in (0, 1) for k in ("exp_avg", "exp_avg_sq")]
        assert all(a is b for a, b in zip(_moments(optimizer), held))


def _bare_distributed_optimizer(inner, **config):
    optimizer = object.__new__(DistributedOptimizer)
    optimizer.optimizer, optimizer.config = inner, OptimizerConfig(**config)
    optimizer.ddp_config, optimizer.grad_scaler = DistributedDataParallelConfig(), None
    optimizer.is_stub_optimizer = False
    return optimizer


class TestDistributedOptimizerCallSites:
    def test_state_dict_exports_through_the_registry(self, register, outcomes):
        register(ExportingAdopter("exporter", torch.optim.Optimizer.state_dict))
        distributed = _bare_distributed_optimizer(_trained_adam(0))

        state_dict = distributed.state_dict()

        assert [(o.hook_point, o.adopter) for o in outcomes] == [("export", "exporter")]
        assert "state" not in state_dict["optimizer"]  # only the groups are kept, as upstream

    def test_megatron_fsdp_load_installs_the_tensors_it_holds(self, register, outcomes):
        register(PyTorchLoaderAdopter("accepting"))
        distributed = _bare_distributed_optimizer(_trained_adam(0))
        distributed.ddp_config.use_megatron_fsdp = True
        moments = _moments(distributed.optimizer)

        distributed.load_state_dict(torch.optim.Optimizer.state_dict(distributed.optimizer))

        assert [(o.hook_point, o.adopter) for o in outcomes] == [("load", "accepting")]
        assert all(a is b for a, b in zip(_moments(distributed.optimizer), moments))

    def test_megatron_fsdp_state_creation_consults_the_registry(self, outcomes):
        distributed = _bare_distributed_optimizer(torch.optim.Adam(_trained_adam(0).param_groups))
        distributed.ddp_config.use_megatron_fsdp = True
        params = [p for g in distributed.optimizer.param_groups for p in g["params"]]
        distributed.param_to_name = {p: f"param{i}" for i, p in enumerate(params)}

        state_dict = distributed.sharded_param_state_fsdp_dtensor(is_loading=True)

        (outcome,) = outcomes
        assert (outcome.hook_point, outcome.adopter) == ("initialize", None)
        assert sorted(state_dict["state"]) == ["param0", "param1"]

    @requires_te_on_cuda
    def test_te_fused_adam_state_is_created_in_one_allocation(self, outcomes):
        optimizer = _te_fused_adam(seed=0)

        initialize_inner_optimizer_state(_owner(optimizer))

        (outcome,) = outcomes
        assert (outcome.hook_point, outcome.adopter) == ("initialize", "te_fused_adam_fp32")
        moments = _moments(optimizer)
        assert len({m.untyped_storage().data_ptr() for m in moments}) == 1
        assert all(m.dtype == torch.float32 and not m.any() for m in moments)
        assert "step" not in optimizer.param_groups[0]  # no dummy step: the groups are untouched


def _bare_float16_optimizer(inner, **config):
    optimizer = object.__new__(Float16OptimizerWithFloat16Params)
    optimizer.optimizer, optimizer.config, optimizer.grad_scaler = (
        inner,
        OptimizerConfig(**config),
        None,
    )
    optimizer.fp32_from_float16_groups = [list(g["params"]) for g in inner.param_groups]
    return optimizer


def _bare_fp32_optimizer(inner, **config):
    optimizer = object.__new__(FP32Optimizer)
    optimizer.optimizer, optimizer.config = inner, OptimizerConfig(**config)
    return optimizer


@pytest.mark.parametrize("make_owner", [_bare_float16_optimizer, _bare_fp32_optimizer])
@pytest.mark.parametrize("switch", [True, False])
def test_non_distributed_optimizers_consult_the_registry(make_owner, switch, register, outcomes):
    adopter = PyTorchLoaderAdopter("accepting")
    register(adopter)
    owner = make_owner(_trained_adam(0), optimizer_state_adoption=switch)
    inner_state_dict = _cloned(_trained_adam(1).state_dict())
    state_dict = inner_state_dict
    if isinstance(owner, Float16OptimizerWithFloat16Params):
        groups = owner.optimizer.param_groups
        main_params = [[p.detach().clone() for p in g["params"]] for g in groups]
        state_dict = {"optimizer": inner_state_dict, "fp32_from_fp16_params": main_params}

    owner.load_state_dict(state_dict)

    assert [o.adopter for o in outcomes] == (["accepting"] if switch else [])
    assert adopter.checked == int(switch)


def test_megatron_lm_arguments_reach_the_config():
    add_megatron_arguments = pytest.importorskip(
        "megatron.training.arguments"
    ).add_megatron_arguments
    training = pytest.importorskip("megatron.training.training")
    get_megatron_optimizer_config = training.get_megatron_optimizer_config

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    defaults = parser.parse_args([])
    assert defaults.optimizer_state_adoption is True
    assert defaults.precision_aware_optimizer_state_adoption is False
    args = parser.parse_args(
        ["--no-optimizer-state-adoption", "--precision-aware-optimizer-state-adoption"]
    )
    config, _ = get_megatron_optimizer_config(
        SimpleNamespace(
            optimizer_state_adoption=args.optimizer_state_adoption,
            precision_aware_optimizer_state_adoption=args.precision_aware_optimizer_state_adoption,
        )
    )
    assert config.optimizer_state_adoption is False
    assert config.precision_aware_optimizer_state_adoption is True


@requires_te_on_cuda
@pytest.mark.parametrize("opt_in", [False, True])
def test_the_precision_aware_adopter_acts_only_where_the_config_opts_in(opt_in):
    settings = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    incoming = _cloned(_te_fused_adam(seed=1, steps=2, **settings).state_dict())
    for entry in incoming["state"].values():  # MCore's scaffold: the moments in BF16
        entry.update({k: entry[k].bfloat16() for k in ("exp_avg", "exp_avg_sq")})
    target = _te_fused_adam(seed=0, **settings)
    owner = _owner(
        target, use_precision_aware_optimizer=True, precision_aware_optimizer_state_adoption=opt_in
    )

    outcome = _load(owner, incoming, default_registry())

    assert outcome.adopter == ("te_fused_adam_bf16" if opt_in else None)
    given = [incoming["state"][i][k] for i in (0, 1) for k in ("exp_avg", "exp_avg_sq")]
    assert all(a is b for a, b in zip(_moments(target), given)) is opt_in
    if not opt_in:
        reason = "OptimizerConfig.precision_aware_optimizer_state_adoption is not set"
        assert dict(outcome.declines)["te_fused_adam_bf16"] == reason
