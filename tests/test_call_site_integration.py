"""The installed megatron-core's other load call sites go through the registry (issue #19).

Besides the DistributedOptimizer's main branch (test_distributed_optimizer_integration.py),
MCore hands freshly loaded state to the inner optimizer's ``load_state_dict`` in

* the Megatron-FSDP branch of ``DistributedOptimizer.load_state_dict``
  (``ddp_config.use_megatron_fsdp``, the ``fsdp_dtensor`` format),
* ``Float16OptimizerWithFloat16Params.load_state_dict`` and
* ``FP32Optimizer.load_state_dict`` (both without ``--use-distributed-optimizer``).

Each test runs at every one of the three, through the installed classes' own, unmodified
``load_state_dict`` (:mod:`mcore_owners`). Like the main routing tests, CI runs them against
every supported release: they pass against the composed build and fail (never error) against
unpatched upstream, where nothing consults the registry and no outcome is recorded.
"""

import dataclasses
import logging
import types
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch
from adopters_for_tests import HalfInstallingAdopter, PyTorchLoaderAdopter
from builders import assert_bitwise_equal, config_with, ddp_config_with, standin_adopter, state_tensors
from fused_adam_standin import FusedAdamStandIn
from mcore_owners import MCORE_PARAM_GROUP_KEYS, CpuDistributedOptimizer, CpuFloat16Optimizer, CpuFP32Optimizer

from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import (
    StateAdoptionOutcome,
    register_state_adopter,
)

DISABLE_ENV_VAR = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"
DISABLED_ADOPTERS_ENV_VAR = "MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS"
ADOPTION_LOGGER = "megatron.core.optimizer.state_adoption"
STANDIN = "te_fused_adam_fp32_standin"


@dataclasses.dataclass
class Site:
    """One call site: how to build its owner around an inner optimizer, and how MCore's
    training loop hands it the loaded state (the inner state dict, wrapped as the owner
    expects it)."""

    make_owner: Callable[[torch.optim.Optimizer, OptimizerConfig], Any]
    wrap: Callable[[torch.optim.Optimizer, Dict[str, Any]], Any]
    has_ddp_config: bool


def _fsdp_owner(optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> Any:
    return CpuDistributedOptimizer(optimizer, config, ddp_config_with(use_megatron_fsdp=True))


SITES = {
    "megatron_fsdp": Site(_fsdp_owner, lambda optimizer, inner: inner, True),
    "float16_optimizer": Site(
        CpuFloat16Optimizer,
        lambda optimizer, inner: {
            "optimizer": inner,
            "fp32_from_fp16_params": [[p.detach().clone() for p in g["params"]] for g in optimizer.param_groups],
        },
        False,
    ),
    "fp32_optimizer": Site(CpuFP32Optimizer, lambda optimizer, inner: inner, False),
}


@pytest.fixture(params=sorted(SITES))
def site(request: pytest.FixtureRequest) -> Site:
    return SITES[request.param]


def _registered(adopter: Any) -> Iterator[Any]:
    handle = register_state_adopter(adopter, prepend=True)
    try:
        yield adopter
    finally:
        handle.remove()


@pytest.fixture
def adam_adopter() -> Iterator[PyTorchLoaderAdopter]:
    yield from _registered(PyTorchLoaderAdopter("test_torch_adam", torch.optim.Adam))


@pytest.fixture
def fp32_standin_adopter() -> Iterator[Any]:
    """The default adopter recognising the stand-in (TE cannot load on a CPU), under its own name."""
    adopter = standin_adopter()
    adopter.name = STANDIN  # an instance attribute of our own adopter object, not a foreign class
    yield from _registered(adopter)


def _params(seed: int) -> List[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(10,), (4, 3), (5,)]]


def _trained(optimizer_class: type, seed: int = 0, **kwargs: Any) -> torch.optim.Optimizer:
    """A trained optimizer with two MCore-style param groups."""
    params = _params(seed)
    optimizer = optimizer_class(
        [{"params": params[:2], **MCORE_PARAM_GROUP_KEYS}, {"params": params[2:], **MCORE_PARAM_GROUP_KEYS, "wd_mult": 0.0}],
        lr=1e-3,
        **kwargs,
    )
    generator = torch.Generator().manual_seed(100 + seed)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return optimizer


def _loaded_state_dict(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The inner state dict as dist-checkpointing hands it over: fresh tensors read from disk."""
    state_dict = optimizer.state_dict()
    state_dict["state"] = {
        key: {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in entry.items()}
        for key, entry in state_dict["state"].items()
    }
    return state_dict


def _load(site: Site, optimizer_class: type = torch.optim.Adam, config: Any = None, **kwargs: Any) -> Tuple[Any, Dict[str, Any]]:
    """Build the site's owner around a trained inner optimizer and load a copy of its state."""
    owner = site.make_owner(_trained(optimizer_class, **kwargs), config or OptimizerConfig())
    incoming = _loaded_state_dict(owner.optimizer)
    owner.load_state_dict(site.wrap(owner.optimizer, incoming))
    return owner, incoming


def _incoming_tensors(incoming: Dict[str, Any]) -> List[torch.Tensor]:
    return [entry[key] for _, entry in sorted(incoming["state"].items()) for key in sorted(entry)]


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))


def _own_loader_result(site: Site, optimizer_class: type, **kwargs: Any) -> List[torch.Tensor]:
    """The state the inner optimizer's own loader gives (the registry switched off)."""
    owner, _ = _load(site, optimizer_class, config_with(optimizer_state_adoption=False), **kwargs)
    return state_tensors(owner.optimizer)


def test_the_load_consults_the_registered_adopters(
    site: Site, adam_adopter: PyTorchLoaderAdopter, outcomes: List[StateAdoptionOutcome]
) -> None:
    owner, incoming = _load(site)
    (context,) = adam_adopter.adopted
    assert context.optimizer is owner.optimizer and context.config is owner.config
    assert context.ddp_config is (owner.ddp_config if site.has_ddp_config else None)
    assert [(o.hook_point, o.adopter) for o in outcomes] == [("load", "test_torch_adam")]
    assert outcomes[0].reused_bytes == _state_bytes(owner.optimizer) and outcomes[0].allocated_bytes == 0
    assert all(a is b for a, b in zip(state_tensors(owner.optimizer), _incoming_tensors(incoming)))


def test_the_default_adopter_declines_torch_adam_and_its_own_loader_runs(
    site: Site, outcomes: List[StateAdoptionOutcome]
) -> None:
    owner, incoming = _load(site)
    (load,) = outcomes
    assert ("te_fused_adam_fp32", "Transformer Engine's FusedAdam is not loaded") in load.declines
    assert load.adopter is None and load.method == "Adam.load_state_dict"
    assert load.fallback_reason == "every adopter declined" and load.error is None


def test_fp32_moments_of_the_te_stand_in_are_adopted_by_reference_and_equal_its_own_loader(
    site: Site, fp32_standin_adopter: Any, outcomes: List[StateAdoptionOutcome]
) -> None:
    """The default adopter's rule at each new call site: FP32 moments of TE's FusedAdam
    (the CPU stand-in reproduces its allocate-and-copy loader) are installed by reference,
    nothing is allocated, and the state is bit for bit what TE's own loader gives."""
    owner, incoming = _load(site, FusedAdamStandIn)
    assert [(o.hook_point, o.adopter) for o in outcomes] == [("load", STANDIN)]
    assert outcomes[0].allocated_bytes == 0 and outcomes[0].reused_bytes == 8 * 27  # 27 FP32 elements
    assert all(a is b for a, b in zip(state_tensors(owner.optimizer), _incoming_tensors(incoming)))
    assert_bitwise_equal(state_tensors(owner.optimizer), _own_loader_result(site, FusedAdamStandIn))
    assert [g["lr"] for g in owner.optimizer.param_groups] == [1e-3, 1e-3]


DECLINES = {
    "precision-aware owner": (
        {"config": types.SimpleNamespace(optimizer_cpu_offload=False, use_precision_aware_optimizer=True, fp16=False)},
        "use_precision_aware_optimizer is set: the optimizer is precision-aware",
    ),
    "CPU-offloaded owner": (
        {"config": config_with(optimizer_cpu_offload=True)},
        "optimizer_cpu_offload is set: the optimizer is CPU-offloaded",
    ),
    "TE master weights": ({"master_weights": True}, "FusedAdam.master_weights is set"),
    "BF16 moments": ({"exp_avg_dtype": torch.bfloat16}, "FusedAdam keeps exp_avg in torch.bfloat16, not torch.float32"),
}


@pytest.mark.parametrize("change, reason", DECLINES.values(), ids=DECLINES.keys())
def test_each_decline_rule_names_itself_and_leaves_the_load_to_te(
    site: Site, fp32_standin_adopter: Any, outcomes: List[StateAdoptionOutcome], change: Dict[str, Any], reason: str
) -> None:
    config = change.get("config")
    optimizer_kwargs = {k: v for k, v in change.items() if k != "config"}
    params = _params(0)
    inner = FusedAdamStandIn(
        [{"params": params, **MCORE_PARAM_GROUP_KEYS}], lr=1e-3, **optimizer_kwargs
    )
    for param in params:
        inner.initialize_state(param, store_param_remainders=False)
    owner = site.make_owner(inner, config or OptimizerConfig())
    incoming = _loaded_state_dict(inner)
    before = inner.allocations
    owner.load_state_dict(site.wrap(inner, incoming))
    (load,) = outcomes
    assert load.declines[0] == (STANDIN, reason)
    assert load.adopter is None and load.method == "FusedAdamStandIn.load_state_dict"
    assert inner.allocations - before == sum(len(entry) for entry in incoming["state"].values())  # TE copied


def test_an_instance_level_loader_runs_exactly_once_instead_of_any_adopter(
    site: Site, adam_adopter: PyTorchLoaderAdopter, outcomes: List[StateAdoptionOutcome]
) -> None:
    calls: List[Dict[str, Any]] = []
    owner = site.make_owner(_trained(torch.optim.Adam), OptimizerConfig())

    def load_state_dict(self: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        calls.append(state_dict)
        torch.optim.Optimizer.load_state_dict(self, state_dict)

    owner.optimizer.load_state_dict = types.MethodType(load_state_dict, owner.optimizer)  # a user's wrapper
    owner.load_state_dict(site.wrap(owner.optimizer, _loaded_state_dict(owner.optimizer)))
    assert len(calls) == 1 and adam_adopter.checked == []
    (load,) = outcomes
    assert load.method == "load_state_dict set on the Adam instance"
    assert load.fallback_reason is not None and "instance has its own load_state_dict" in load.fallback_reason


def test_a_load_pre_hook_sends_the_load_to_the_own_loader(
    site: Site, adam_adopter: PyTorchLoaderAdopter, outcomes: List[StateAdoptionOutcome]
) -> None:
    """HybridDeviceOptimizer (CPU offload) registers such hooks; they run exactly once."""
    owner = site.make_owner(_trained(torch.optim.Adam), OptimizerConfig())
    ran: List[int] = []
    owner.optimizer.register_load_state_dict_pre_hook(lambda optimizer, state_dict: ran.append(1))
    owner.load_state_dict(site.wrap(owner.optimizer, _loaded_state_dict(owner.optimizer)))
    assert ran == [1] and adam_adopter.checked == []
    assert outcomes[0].fallback_reason == "a load_state_dict pre-hook is registered, which the own load_state_dict runs"


def test_a_failing_adopter_is_rolled_back_and_the_own_loader_loads(
    site: Site, outcomes: List[StateAdoptionOutcome], caplog: pytest.LogCaptureFixture
) -> None:
    handles = [register_state_adopter(HalfInstallingAdopter(), prepend=True)]
    try:
        with caplog.at_level(logging.WARNING, logger=ADOPTION_LOGGER):
            owner, _ = _load(site)
    finally:
        for handle in handles:
            handle.remove()
    assert "failed while installing" in caplog.text
    (load,) = outcomes
    assert (load.adopter, load.fallback_reason) == (None, "adopter 'half_installing' failed while installing the state")
    assert [len(g["params"]) for g in owner.optimizer.param_groups] == [2, 1]
    assert [g["lr"] for g in owner.optimizer.param_groups] == [1e-3, 1e-3]
    assert_bitwise_equal(state_tensors(owner.optimizer), _own_loader_result(site, torch.optim.Adam))


def test_the_kill_switch_and_disabling_by_name_reach_the_call_site(
    site: Site, adam_adopter: PyTorchLoaderAdopter, outcomes: List[StateAdoptionOutcome],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv(DISABLE_ENV_VAR, "1")
    _load(site)
    assert adam_adopter.checked == []
    assert outcomes[-1].fallback_reason == f"{DISABLE_ENV_VAR}=1 is set"
    monkeypatch.delenv(DISABLE_ENV_VAR)
    monkeypatch.setenv(DISABLED_ADOPTERS_ENV_VAR, "test_torch_adam")
    _load(site)
    assert adam_adopter.adopted == []
    assert ("test_torch_adam", f"disabled by {DISABLED_ADOPTERS_ENV_VAR}") in outcomes[-1].declines


def test_the_config_switch_selects_the_own_loader(
    site: Site, adam_adopter: PyTorchLoaderAdopter, outcomes: List[StateAdoptionOutcome]
) -> None:
    _load(site, config=config_with(optimizer_state_adoption=False))
    assert adam_adopter.checked == []
    assert [(o.adopter, o.fallback_reason) for o in outcomes] == [
        (None, "OptimizerConfig.optimizer_state_adoption is False")
    ]


def test_megatron_fsdp_creates_the_state_it_loads_into_through_the_registry(
    outcomes: List[StateAdoptionOutcome],
) -> None:
    """``sharded_param_state_fsdp_dtensor(is_loading=True)`` (Megatron-FSDP) hands the creation
    of the state to ``initialize_inner_optimizer_state``; the default adopter declines torch
    Adam, so the dummy step runs, exactly once (test_initialize_hook_point.py has the rest)."""
    params = _params(0)
    inner = torch.optim.Adam([{"params": params, **MCORE_PARAM_GROUP_KEYS}], lr=1e-3)
    owner = _fsdp_owner(inner, OptimizerConfig())
    owner.param_to_name = {p: f"param{i}" for i, p in enumerate(params)}  # what _param_name caches
    state_dict = owner.sharded_param_state_fsdp_dtensor(is_loading=True)
    assert [(o.hook_point, o.adopter) for o in outcomes] == [("initialize", None)]
    assert outcomes[0].method is not None and outcomes[0].method.endswith("_init_optimizer_states_with_dummy_values")
    assert ("te_fused_adam_fp32", "Transformer Engine's FusedAdam is not loaded") in outcomes[0].declines
    assert sorted(state_dict["state"]) == ["param0", "param1", "param2"]
    assert all(int(inner.state[p]["step"]) == 1 for p in params)
