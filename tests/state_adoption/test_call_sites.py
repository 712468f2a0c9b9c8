"""Routing: every Megatron-Core call site consults the process-wide registry.

Through the installed megatron-core's own, unmodified methods (``mcore_owners`` builds its
optimizer classes on the CPU): both passes of ``DistributedOptimizer.load_state_dict``'s main
branch (its export and its load), its Megatron-FSDP branch, Megatron-FSDP's initialization, the
precision-aware ``dp_reshardable`` read, the non-distributed ``Float16OptimizerWithFloat16Params``
and ``FP32Optimizer`` loads, ``ChainedOptimizer``, and the installed plugins (loaded at the first
consultation, not by ``MegatronOptimizer``'s constructor).

``scripts/run-tests.sh`` runs this file against every supported release: it passes against the
composed X+stateadoption and fails (never errors) against unpatched upstream X with the subsystem
copied in, where no call site consults the registry (and ``OptimizerConfig`` has no switch).
"""

import dataclasses
import logging
import re
import sys
import types
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch
from adopters_for_tests import HalfInstallingAdopter, PyTorchLoaderAdopter
from builders import (
    StandInFP32Adopter,
    assert_bitwise_equal,
    config_with,
    ddp_config_with,
    state_tensors,
)
from fused_adam_standin import FusedAdamStandIn
from mcore_owners import (
    MCORE_PARAM_GROUP_KEYS,
    CpuDistributedOptimizer,
    CpuFloat16Optimizer,
    CpuFP32Optimizer,
    precision_aware_owner,
)

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.optimizer import ChainedOptimizer, distrib_optimizer
from megatron.core.optimizer.distrib_optimizer import Range
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.state_adoption import (
    AdoptionOutcome,
    TEFusedAdamPrecisionAwareStateAdopter,
    default_registry,
    initialize_inner_optimizer_state,
)

SIZES = (10, 12, 5)  # flat main-parameter shards, in two MCore-style param groups


def _adam(steps: int = 2, seed: int = 0, cls: type = torch.optim.Adam, **kwargs: Any) -> Any:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in SIZES]
    groups = [{"params": params[:2], **MCORE_PARAM_GROUP_KEYS},
              {"params": params[2:], **MCORE_PARAM_GROUP_KEYS, "wd_mult": 0.0}]  # fmt: skip
    optimizer = cls(groups, lr=1e-3, **kwargs)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def _distributed(inner: Any, config: Any = None, fsdp: bool = False) -> CpuDistributedOptimizer:
    """The installed DistributedOptimizer with what its load reads: one bucket of the flat
    shards (pass 1 sizes the state it allocates by it) and the names Megatron-FSDP uses."""
    ddp_config = (
        ddp_config_with(use_megatron_fsdp=True) if fsdp else DistributedDataParallelConfig()
    )
    owner = CpuDistributedOptimizer(inner, config or OptimizerConfig(), ddp_config)
    params = [p for group in inner.param_groups for p in group["params"]]
    owner.model_param_group_index_map = {
        p: (g, i)
        for g, group in enumerate(inner.param_groups)
        for i, p in enumerate(group["params"])
    }
    owner.gbuf_ranges = _one_bucket(params)
    owner.param_to_name = {p: f"decoder.param{i}" for i, p in enumerate(params)}
    return owner


def _one_bucket(params: List[torch.Tensor]) -> List[Dict[torch.dtype, List[Dict[str, Any]]]]:
    """``gbuf_ranges`` of one DP rank holding all of one bucket, the shards back to back."""
    param_map, start = {}, 0
    for param in params:
        place = Range(start, start + param.numel())
        param_map[param], start = {"gbuf_world": place, "gbuf_local": place}, start + param.numel()
    return [{torch.float32: [{"param_map": param_map}]}]


def _outer(optimizer: Any) -> Dict[str, Any]:
    """What MCore hands DistributedOptimizer.load_state_dict: the checkpoint's param groups."""
    groups = torch.optim.Optimizer.state_dict(optimizer)["param_groups"]
    return {
        "optimizer": {
            "param_groups": [
                dict({k: v for k, v in g.items() if k != "params"}, step=2) for g in groups
            ]
        }
    }


def _handed_back(optimizer: Any) -> Dict[str, Any]:
    """The optimizer's own state handed back (Megatron-FSDP reads the checkpoint into it in
    place): the by-reference install that a call site not owning the state dict allows."""
    state_dict = torch.optim.Optimizer.state_dict(optimizer)
    state_dict["state"] = {key: dict(entry) for key, entry in state_dict["state"].items()}
    return state_dict


def _from_disk(optimizer: Any) -> Dict[str, Any]:
    """Another run's inner state dict as a checkpoint load hands it over: the caller's tensors."""
    state_dict = torch.optim.Optimizer.state_dict(_adam(seed=1))
    state_dict["state"] = {
        k: {n: v.clone() for n, v in e.items()} for k, e in state_dict["state"].items()
    }
    return state_dict


@dataclasses.dataclass
class Site:
    """One load call site: its owner around an inner optimizer, MCore's call, and what it tells
    the adopters: whether it owns the state dict, and its outcomes' hook points."""

    make: Callable[[Any, Any], Any]
    load: Callable[[Any], None]
    owns: bool
    points: Tuple[str, ...] = ("load",)
    fresh: bool = False  # the inner optimizer holds no state yet (pass 1)


SITES = {
    "DistributedOptimizer pass 1": Site(_distributed, lambda o: o.load_state_dict(_outer(o.optimizer)), True,
                                        ("export", "load"), fresh=True),
    "DistributedOptimizer pass 2": Site(_distributed, lambda o: o.load_state_dict(_outer(o.optimizer)), True,
                                        ("export", "load")),
    "DistributedOptimizer Megatron-FSDP": Site(lambda inner, config: _distributed(inner, config, fsdp=True),
                                               lambda o: o.load_state_dict(_handed_back(o.optimizer)), False),
    "Float16OptimizerWithFloat16Params": Site(CpuFloat16Optimizer, lambda o: o.load_state_dict(
        {"optimizer": _from_disk(o.optimizer),
         "fp32_from_fp16_params": [[p.detach().clone() for p in g["params"]] for g in o.optimizer.param_groups]}),
        False),
    "FP32Optimizer": Site(CpuFP32Optimizer, lambda o: o.load_state_dict(_from_disk(o.optimizer)), False),
}  # fmt: skip


def _assert_same_state(site: Site, mine: Any, theirs: Any) -> None:
    """The same groups and state; the same values unless pass 1's ``torch.empty`` made them."""
    layout = [[(k, v.dtype, v.shape) for k, v in sorted(o.state[p].items())]
              for o in (mine, theirs) for g in o.param_groups for p in g["params"]]  # fmt: skip
    assert layout[: len(layout) // 2] == layout[len(layout) // 2 :]
    assert [{**g, "params": len(g["params"])} for g in mine.param_groups] == [
        {**g, "params": len(g["params"])} for g in theirs.param_groups]  # fmt: skip
    if not site.fresh:
        assert_bitwise_equal(state_tensors(mine), state_tensors(theirs))


@pytest.fixture(autouse=True)
def _cuda_device_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pass 1 allocates its state on ``torch.cuda.current_device()``: here, the CPU."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.fixture
def adam_adopter() -> Iterator[PyTorchLoaderAdopter]:
    """An adopter of torch Adam (every role) first in the process-wide registry."""
    adopter = PyTorchLoaderAdopter("routing_adam", torch.optim.Adam)
    handle = default_registry().register(adopter, prepend=True)
    yield adopter
    handle.remove()


def _site(name: str, config: Any = None, **kwargs: Any) -> Any:
    site = SITES[name]
    return site.make(_adam(steps=0 if site.fresh else 2, **kwargs), config or OptimizerConfig())


@pytest.mark.parametrize("name", SITES)
def test_every_load_site_consults_the_registry_and_loads_what_the_own_code_loads(
    name: str, adam_adopter: PyTorchLoaderAdopter, outcomes: List[AdoptionOutcome]
) -> None:
    site, owner = SITES[name], _site(name)
    site.load(owner)
    assert [(o.hook_point, o.adopter) for o in outcomes] == [
        (p, "routing_adam") for p in site.points
    ]
    (context,) = adam_adopter.adopted
    assert context.optimizer is owner.optimizer and context.config is owner.config
    assert (
        context.ddp_config is getattr(owner, "ddp_config", None)
        and context.owns_state_dict is site.owns
    )
    assert outcomes[-1].allocated_bytes == 0 and outcomes[-1].reused_bytes > 0
    reported = len(outcomes)
    own = _site(name, config_with(optimizer_state_adoption=False))
    site.load(own)
    assert len(outcomes) == reported  # adoption off: upstream's call and nothing else
    _assert_same_state(site, owner.optimizer, own.optimizer)


@pytest.mark.parametrize("name", SITES)
def test_an_instance_level_load_state_dict_runs_exactly_once_instead_of_any_adopter(
    name: str, adam_adopter: PyTorchLoaderAdopter, outcomes: List[AdoptionOutcome]
) -> None:
    """Megatron-Bridge sets a ``load_state_dict`` on the inner optimizer instance: upstream's call
    runs it, once; no adopter is asked."""
    owner, calls = _site(name), []

    def load_state_dict(self: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        calls.append(state_dict)
        torch.optim.Optimizer.load_state_dict(self, state_dict)

    owner.optimizer.load_state_dict = types.MethodType(load_state_dict, owner.optimizer)
    SITES[name].load(owner)
    (load,) = [o for o in outcomes if o.hook_point == "load"]
    loads_checked = [context for context in adam_adopter.checked if context.state_dict is not None]
    assert len(calls) == 1 and adam_adopter.adopted == [] and loads_checked == []
    assert (load.adopter, load.method) == (None, "load_state_dict set on the Adam instance")
    assert load.fallback_reason == "the Adam instance has its own load_state_dict"


@pytest.mark.parametrize("name", SITES)
def test_a_failing_adopter_leaves_the_megatron_optimizer_loaded_by_its_own_code(
    name: str,
    outcomes: List[AdoptionOutcome],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(default_registry(), "strict", False)  # warn and fall back, as in production
    # A name of its own per site: the registry warns once per message.
    adopter = HalfInstallingAdopter(re.sub(r"\W+", "_", f"half_installing {name}"))
    handle = default_registry().register(adopter, prepend=True)
    try:
        owner = _site(name)
        with caplog.at_level(logging.WARNING, logger="megatron.core.optimizer.state_adoption"):
            SITES[name].load(owner)
    finally:
        handle.remove()
    (load,) = [o for o in outcomes if o.hook_point == "load"]
    failed = f"adopter {adopter.name!r} failed and was undone"
    assert (load.adopter, load.fallback_reason) == (None, failed)
    assert caplog.messages == [
        f"Optimizer state adoption: {failed}; the own code runs for {load.optimizer} "
        "(RuntimeError: failed half-way)"
    ]
    reference = _site(name, config_with(optimizer_state_adoption=False))
    SITES[name].load(reference)
    _assert_same_state(SITES[name], owner.optimizer, reference.optimizer)


def test_a_chained_optimizer_loads_each_distributed_optimizer_through_the_registry(
    adam_adopter: PyTorchLoaderAdopter, outcomes: List[AdoptionOutcome]
) -> None:
    dense, expert = _distributed(_adam(seed=0)), _distributed(_adam(seed=1))
    ChainedOptimizer([dense, expert]).load_state_dict(
        [_outer(dense.optimizer), _outer(expert.optimizer)]
    )
    assert [c.optimizer for c in adam_adopter.adopted] == [dense.optimizer, expert.optimizer]
    loads = [o.optimizer.split()[1] for o in outcomes if o.hook_point == "load"]
    assert loads == [f"{id(dense.optimizer):#x}", f"{id(expert.optimizer):#x}"]


# --- Megatron-FSDP's initialization and the precision-aware read ----------------------------


def _fsdp_initialize(config: Any = None) -> Any:
    owner = _distributed(_adam(steps=0, cls=FusedAdamStandIn), config, fsdp=True)
    state_dict = owner.sharded_param_state_fsdp_dtensor(is_loading=True)
    assert sorted(state_dict["state"]) == ["decoder.param0", "decoder.param1", "decoder.param2"]
    return owner


def test_megatron_fsdp_initializes_the_state_through_the_registry(
    outcomes: List[AdoptionOutcome],
) -> None:
    """The stand-in's own step without gradients creates the state instead of the dummy step,
    which runs where no adopter accepts (it is the initialization MCore hands over) and, without
    an outcome, with adoption off; all three leave the same state."""
    handle = default_registry().register(StandInFP32Adopter(FusedAdamStandIn, "cpu", "2.20.2"), prepend=True)
    try:
        ours = _fsdp_initialize()
    finally:
        handle.remove()
    assert [(o.hook_point, o.adopter) for o in outcomes] == [
        ("initialize", "te_fused_adam_fp32_standin")
    ]
    assert all(p.grad is None for g in ours.optimizer.param_groups for p in g["params"])
    declined = _fsdp_initialize()
    assert [(o.adopter, o.method) for o in outcomes[1:]] == [
        (None, "DistributedOptimizer._init_optimizer_states_with_dummy_values")
    ]
    off = _fsdp_initialize(config_with(optimizer_state_adoption=False))
    assert len(outcomes) == 2
    for own in (declined, off):
        assert_bitwise_equal(state_tensors(ours.optimizer), state_tensors(own.optimizer))
        assert (
            [g["step"] for g in ours.optimizer.param_groups]
            == [g["step"] for g in own.optimizer.param_groups]
            == [1, 1]
        )


class _Reached(BaseException):
    """Raised by :class:`_StoppingInitializer`: the call reached the registry; nothing after runs."""


class _StoppingInitializer(PyTorchLoaderAdopter):
    """Accepts torch Adam's initialization and stops the call there."""

    def initialize(self, context: Any) -> None:
        raise _Reached(context)


SHARDED_LOADS = {
    "DistributedOptimizer": lambda inner: _distributed(inner),
    "FP32Optimizer": lambda inner: CpuFP32Optimizer(inner, OptimizerConfig()),
}  # fmt: skip


@pytest.mark.parametrize("name", SHARDED_LOADS)
def test_a_sharded_state_dict_for_a_load_creates_the_state_through_the_registry(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before a ``torch_dist`` read, the state it is read into is the first accepting adopter's
    to create (the distributed optimizer's placeholders, FP32Optimizer's ``init_state_fn``); undone when it
    stops the call. The distributed optimizer's ``state_dict`` reads a fresh optimizer's step
    from its groups where TE is installed, as on a GPU: its flags say so here."""
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    owner = SHARDED_LOADS[name](_adam(steps=0))
    handle = default_registry().register(_StoppingInitializer("stopping", torch.optim.Adam), prepend=True)
    try:
        with pytest.raises(_Reached) as reached:
            owner.sharded_state_dict({}, is_loading=True, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    finally:
        handle.remove()
    assert reached.value.args[0].optimizer is owner.optimizer and len(owner.optimizer.state) == 0


def test_the_distributed_optimizers_first_load_keeps_the_state_the_adopter_created(
    monkeypatch: pytest.MonkeyPatch, outcomes: List[AdoptionOutcome]
) -> None:
    """``sharded_state_dict(is_loading=True)``'s first steps with TE (the stand-in, and TE's flags
    as on a GPU): the FP32 adopter creates the moments in one allocation, and the pass-1
    ``load_state_dict(state_dict())`` keeps them (no placeholders, no copy, no group stepped)."""
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    owner = _distributed(_adam(steps=0, cls=FusedAdamStandIn))
    handle = default_registry().register(StandInFP32Adopter(FusedAdamStandIn, "cpu", "2.20.2"), prepend=True)
    try:
        initialize_inner_optimizer_state(owner)
        created = state_tensors(owner.optimizer)
        owner.load_state_dict(owner.state_dict())
    finally:
        handle.remove()
    standin = "te_fused_adam_fp32_standin"  # the exports are TE's own: they copy no FP32 state
    assert [(o.hook_point, o.adopter) for o in outcomes] == [
        ("initialize", standin), ("export", None), ("export", None), ("load", standin)]  # fmt: skip
    assert all(a is b for a, b in zip(state_tensors(owner.optimizer), created)) and len(created) == 6
    assert len({t.untyped_storage().data_ptr() for t in created}) == 1
    assert owner.optimizer.allocations == 0 and all("step" not in g for g in owner.optimizer.param_groups)


def _precision_aware_adopter() -> TEFusedAdamPrecisionAwareStateAdopter:
    """The precision-aware adopter for the stand-in, under a name of its own (the example
    plugin, if installed, registers the class under its default name)."""
    return TEFusedAdamPrecisionAwareStateAdopter(FusedAdamStandIn, "cpu", name="precision_aware_standin")


def _precision_aware(config: Any = None, initialize: bool = True) -> Any:
    """The installed precision-aware DistributedOptimizer before a read: TE's BF16 moments and
    int16 remainders of BF16 flat shards (``initialize_state``, unless not to ``initialize``),
    one bucket of them."""
    optimizer = _adam(steps=0, cls=FusedAdamStandIn, master_weights=True, store_param_remainders=True,
                      exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)  # fmt: skip
    for group in optimizer.param_groups:
        group["params"] = [torch.nn.Parameter(p.detach().bfloat16()) for p in group["params"]]
    owner = precision_aware_owner(optimizer, initialize, **({} if config is None else config))
    owner.gbuf_ranges, numel = _one_bucket(list(owner.model_param_group_index_map)), sum(SIZES)
    bucket = types.SimpleNamespace(numel_unpadded=numel, grad_data=torch.empty(numel))
    owner.buffers = [types.SimpleNamespace(buckets=[bucket])]
    owner.data_parallel_group = types.SimpleNamespace(rank=lambda: 0, size=lambda: 1)
    owner.data_parallel_group_idx = owner.distributed_optimizer_instance_id = 0
    owner.per_bucket_numel = owner.per_bucket_numel_unpadded = [[numel]]
    return owner


def _read_and_store(owner: Any) -> List[Dict[str, torch.Tensor]]:
    """Build the sharded state dict for loading, read a checkpoint into its tensors as
    ``torch_dist`` does (``copy_``), and store each parameter's as MCore's load does."""
    state = owner.sharded_param_state_dp_reshardable({}, is_loading=True)
    generator = torch.Generator().manual_seed(3)
    read = []
    for entry, param in zip(state[0][torch.float32][0], owner.model_param_group_index_map):
        tensors = {k: v.data for k, v in entry.items() if isinstance(v, ShardedTensor)}
        for target in tensors.values():
            if target.dtype == torch.int16:
                target.copy_(torch.randint(-(2**15), 2**15, target.shape, generator=generator))
            else:
                target.copy_(torch.randn(target.shape, generator=generator) / 3)
        owner._set_main_param_and_optimizer_states(param, tensors)
        read.append(tensors)
    return read


def test_the_precision_aware_read_takes_its_targets_from_the_registry(
    outcomes: List[AdoptionOutcome],
) -> None:
    """``sharded_param_state_dp_reshardable(is_loading=True)`` reads into the held BF16 moments
    the opt-in adopter supplies; the state after the store is upstream's (FP32 copies)."""
    handle = default_registry().register(_precision_aware_adopter(), prepend=True)
    try:
        ours = _precision_aware()
        targets = _read_and_store(ours)
    finally:
        handle.remove()
    assert [(o.hook_point, o.adopter, o.allocated_bytes) for o in outcomes] == [
        ("read", "precision_aware_standin", 0)
    ]
    for tensors, param in zip(targets, ours.model_param_group_index_map):
        assert all(tensors[k] is ours.optimizer.state[param][k] for k in ("exp_avg", "exp_avg_sq"))
    upstream = _precision_aware()
    assert all(t["exp_avg"].dtype == torch.float32 for t in _read_and_store(upstream))
    assert outcomes[-1].method == "FusedAdamStandIn.get_unscaled_state"
    assert_bitwise_equal(state_tensors(ours.optimizer), state_tensors(upstream.optimizer))


def test_the_precision_aware_first_load_and_read_keep_the_state_the_adopter_created(
    monkeypatch: pytest.MonkeyPatch, outcomes: List[AdoptionOutcome]
) -> None:
    """``sharded_state_dict(is_loading=True)``'s steps with the opt-in adopter (the stand-in, and
    TE's flags as on a GPU): it creates TE's state in one allocation per dtype; both exports of
    the pass-1 ``load_state_dict(state_dict())`` are the held tensors (no FP32 copies of the BF16
    moments), its load keeps them, and the read targets them."""
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    handle = default_registry().register(_precision_aware_adopter(), prepend=True)
    try:
        owner = _precision_aware(initialize=False)
        initialize_inner_optimizer_state(owner)
        created = state_tensors(owner.optimizer)
        owner.load_state_dict(owner.state_dict())
        read = _read_and_store(owner)
    finally:
        handle.remove()
    name = "precision_aware_standin"
    assert [(o.hook_point, o.adopter) for o in outcomes] == [
        ("initialize", name), ("export", name), ("export", name), ("load", name), ("read", name)]  # fmt: skip
    assert all(a is b for a, b in zip(state_tensors(owner.optimizer), created)) and len(created) == 9
    assert len({t.untyped_storage().data_ptr() for t in created}) == 2  # BF16 moments, int16
    for tensors, param in zip(read, owner.model_param_group_index_map):
        assert all(tensors[k] is owner.optimizer.state[param][k] for k in ("exp_avg", "exp_avg_sq"))
    assert owner.optimizer.allocations == 0


# --- the switches -------------------------------------------------------------------------


def _off_load(name: str) -> Callable[[], Any]:
    return lambda: SITES[name].load(_site(name, config_with(optimizer_state_adoption=False)))


SWITCHED = {
    **{name: _off_load(name) for name in SITES},
    "Megatron-FSDP initialization": lambda: _fsdp_initialize(
        config_with(optimizer_state_adoption=False)
    ),
    "precision-aware read": lambda: _read_and_store(
        _precision_aware({"optimizer_state_adoption": False})
    ),
}


@pytest.mark.parametrize("site", SWITCHED)
def test_the_config_switch_reaches_every_site_and_asks_no_adopter(
    site: str, adam_adopter: PyTorchLoaderAdopter, outcomes: List[AdoptionOutcome]
) -> None:
    """With adoption off nothing of the subsystem runs: no adopter is asked, no outcome is
    reported (an outcome hook is registered)."""
    handle = default_registry().register(_precision_aware_adopter(), prepend=True)
    try:
        SWITCHED[site]()
    finally:
        handle.remove()
    assert outcomes == [] and adam_adopter.checked == []


PLUGIN = """
from megatron.core.optimizer.state_adoption import StateAdopter

made = []


class RoutingPlugin(StateAdopter):
    name = "routing_plugin"

    def __init__(self):
        made.append(self)

    def decline_reason(self, context):
        return "installed for the routing test"

    def adopt(self, context):
        raise AssertionError("never accepted")
"""
PLUGIN_GROUP = "test.routing_adopters"


class _Constructed(CpuFP32Optimizer):
    """Constructed by MegatronOptimizer's own constructor (FP32Optimizer's then allocates CUDA)."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> None:
        MegatronOptimizer.__init__(self, optimizer, config)


def test_the_installed_plugins_load_once_at_the_first_consultation_not_at_construction(
    install_plugin: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    outcomes: List[AdoptionOutcome],
) -> None:
    """Constructing Megatron optimizers and loading with adoption off import no plugin; the
    first load that consults the process-wide registry registers it, once, after the built-in
    adopters, and it is asked from then on."""
    registry = default_registry()
    monkeypatch.setattr(registry, "_plugin_group", PLUGIN_GROUP)  # plugins not loaded yet
    monkeypatch.setattr(registry, "_adopters", OrderedDict(registry._adopters))  # undone after
    install_plugin("routing_plugin_dist", {"routing_plugin": "routing_plugin_dist:RoutingPlugin"},
                   PLUGIN, PLUGIN_GROUP)  # fmt: skip
    owners = [_Constructed(_adam(), OptimizerConfig()) for _ in range(2)]
    off = _Constructed(_adam(), config_with(optimizer_state_adoption=False))
    off.load_state_dict(_from_disk(off.optimizer))
    assert "routing_plugin_dist" not in sys.modules and outcomes == []
    for owner in owners:
        owner.load_state_dict(_from_disk(owner.optimizer))
    assert [
        (o.adopter, o.method, ("routing_plugin", "installed for the routing test") in o.declines)
        for o in outcomes
    ] == [(None, "Adam.load_state_dict", True)] * 2
    names = [adopter.name for adopter in registry.adopters()]
    assert len(sys.modules["routing_plugin_dist"].made) == names.count("routing_plugin") == 1
    assert names.index("te_fused_adam_fp32") < names.index("routing_plugin")
