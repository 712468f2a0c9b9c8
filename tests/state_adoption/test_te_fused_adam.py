"""The built-in FP32 adopter (``te_fused_adam_fp32``): it installs by reference, at every call
site, what TE's loader copies; the result and the next step are TE's bit for bit; every decline
rule is named by its reason and leaves the load to TE; the initialize role for Megatron-FSDP.

TE cannot load without a GPU: ``FusedAdamStandIn`` (tests/fused_adam_standin.py) reproduces
FusedAdam's allocate-and-copy loader and its step, and results are compared with what it gives.
Megatron-FSDP's state is real DTensors on a one-rank gloo mesh.
"""

import sys
import types
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from builders import (
    Owner,
    assert_bitwise_equal,
    cloned_state_dict,
    config_with,
    ddp_config_with,
    fresh_standin,
    make_context,
    numel_bytes,
    outcome_of,
    registry_of,
    set_grads,
    standin_adopter,
    state_tensors,
    trained_standin,
)
from fused_adam_standin import FusedAdamStandIn
from mcore_owners import MCORE_PARAM_GROUP_KEYS, CpuDistributedOptimizer
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron.core.optimizer.state_adoption import (
    AdoptionContext,
    AdoptionOutcome,
    initialize_inner_optimizer_state,
    load_inner_optimizer_state_dict,
)
from megatron.core.optimizer.state_adoption import allocation
from megatron.core.optimizer.state_adoption.te_fused_adam import TEFusedAdamFP32StateAdopter

NAME = "te_fused_adam_fp32"
MOMENTS = ("exp_avg", "exp_avg_sq")
KEYS = "['exp_avg', 'exp_avg_sq']"
STATE_METHODS = ("load_state_dict", "state_dict", "initialize_state", "_initialize_state",
                 "set_scaled_state", "get_unscaled_state", "_apply_scale")  # fmt: skip
FSDP = ddp_config_with(use_megatron_fsdp=True)
AWARE = types.SimpleNamespace(optimizer_cpu_offload=False, use_precision_aware_optimizer=True)


def _params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _payload(**changes: Any) -> Dict[str, Any]:
    """A trained stand-in's state dict with cloned tensors: a checkpoint's payload."""
    return cloned_state_dict(trained_standin(**changes))


def _load(adopter: Any, context: AdoptionContext) -> AdoptionOutcome:
    """Load the context's state dict through a registry of ``adopter`` (None: no adopter)."""
    c = context
    owner = Owner(c.optimizer, c.config, c.ddp_config, c.is_stub_optimizer)
    registry = registry_of(*filter(None, [adopter]))
    return outcome_of(
        registry,
        lambda: load_inner_optimizer_state_dict(
            owner, c.state_dict, owns_state_dict=c.owns_state_dict, registry=registry
        ),
    )


# --- adoption by reference ------------------------------------------------------------------


@pytest.mark.parametrize(
    "owner, owns",
    [({}, True), ({"ddp_config": None}, True), ({"ddp_config": FSDP}, True), ({}, False)],
    ids=["distributed", "non-distributed", "Megatron-FSDP", "the held tensors handed back"],
)
def test_fp32_moments_are_installed_by_reference_where_tes_loader_copies(
    owner: Dict[str, Any], owns: bool
) -> None:
    """8 B per element reused, none allocated, the incoming tensors themselves installed. The
    held state handed back (MCore's second pass) is reused whoever owns the state dict."""
    optimizer = fresh_standin() if owns else trained_standin()
    state_dict = _payload() if owns else torch.optim.Optimizer.state_dict(optimizer)
    incoming = [state_dict["state"][i][k] for i in sorted(state_dict["state"]) for k in MOMENTS]
    allocations = optimizer.allocations
    outcome = _load(
        standin_adopter(), make_context(optimizer, state_dict, owns_state_dict=owns, **owner)
    )
    assert (outcome.adopter, outcome.declines, outcome.error) == (NAME, (), None)
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (
        numel_bytes(optimizer),
        0,
    ), f"torch {torch.__version__}'s loader copied: no by-reference install (PyTorch #196083)"
    assert all(a is b for a, b in zip(state_tensors(optimizer), incoming))
    assert optimizer.allocations == allocations
    own = _load(None, make_context(fresh_standin(), _payload(), owns_state_dict=True))
    assert (own.method, own.reused_bytes) == ("FusedAdamStandIn.load_state_dict", 0)
    assert own.allocated_bytes == numel_bytes(optimizer)  # TE's second copy


@pytest.mark.parametrize(
    "release, te_version", [((1, 13), "1.13.0"), ((2, 0), "2.0.0"), ((2, 20), "2.20.2")]
)
def test_adoption_equals_tes_loader_bit_for_bit_and_so_does_the_next_step(
    release: Tuple[int, int], te_version: str
) -> None:
    def payload() -> Dict[str, Any]:
        state_dict = _payload()
        state_dict["param_groups"][1]["lr"] = 0.123
        return state_dict

    adopted, by_te = fresh_standin(te_release=release), fresh_standin(te_release=release)
    context = make_context(adopted, payload(), owns_state_dict=True)
    assert _load(standin_adopter(te_version=te_version), context).adopter == NAME
    by_te.load_state_dict(payload())
    assert_bitwise_equal(state_tensors(adopted), state_tensors(by_te))
    groups = [
        [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
        for o in (adopted, by_te)
    ]
    assert groups[0] == groups[1] and [(g["step"], g["lr"]) for g in adopted.param_groups] == [
        (2, 1e-3),
        (2, 0.123),
    ]
    assert adopted.param_groups[1]["params"][0] is _params(adopted)[2]
    for optimizer in (adopted, by_te):
        set_grads(_params(optimizer), step=2)
        optimizer.step()
    assert_bitwise_equal(_params(adopted), _params(by_te))
    assert_bitwise_equal(state_tensors(adopted), state_tensors(by_te))


def test_disjoint_views_of_one_buffer_are_installed_by_reference() -> None:
    optimizer, state_dict = fresh_standin(), _payload()
    buffer = torch.cat([state_dict["state"][2]["exp_avg"], state_dict["state"][3]["exp_avg"]])
    state_dict["state"][2]["exp_avg"], state_dict["state"][3]["exp_avg"] = buffer[:7], buffer[7:]
    outcome = _load(standin_adopter(), make_context(optimizer, state_dict, owns_state_dict=True))
    assert (outcome.adopter, outcome.reused_bytes, outcome.allocated_bytes) == (
        NAME,
        numel_bytes(optimizer),
        0,
    )


def test_te_is_looked_up_among_the_imported_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a class given, ``FusedAdam`` is taken from the loaded TE module (never imported)."""
    context = make_context(fresh_standin(), _payload(), owns_state_dict=True)
    adopter = TEFusedAdamFP32StateAdopter(device_type="cpu", te_version="2.20.2")
    assert adopter.decline_reason(context) == "Transformer Engine's FusedAdam is not loaded"
    module = types.ModuleType("transformer_engine.pytorch.optimizers.fused_adam")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    module.FusedAdam = lambda *args: FusedAdamStandIn(*args)  # type: ignore[attr-defined]
    assert adopter.decline_reason(context) == "Transformer Engine's FusedAdam is not loaded"
    module.FusedAdam = FusedAdamStandIn  # type: ignore[attr-defined]
    assert adopter.decline_reason(context) is None
    assert repr(adopter) == "TEFusedAdamFP32StateAdopter(name='te_fused_adam_fp32')"


# --- every decline rule, by its reason ------------------------------------------------------

Build = Callable[[], Tuple[TEFusedAdamFP32StateAdopter, AdoptionContext]]


def _case(sd: Any = None, opt: Any = None, adopter: Any = standin_adopter, **owner: Any) -> Build:
    """A fresh stand-in changed by ``opt(optimizer)``, a payload the call site owns changed by
    ``sd(state_dict, optimizer)``, the owner's fields ``owner``."""

    def build() -> Tuple[TEFusedAdamFP32StateAdopter, AdoptionContext]:
        optimizer, state_dict = fresh_standin(), _payload()
        optimizer = opt(optimizer) or optimizer if opt else optimizer
        if sd is not None:
            sd(state_dict, optimizer)
        return adopter(), make_context(optimizer, state_dict, **{"owns_state_dict": True, **owner})

    return build


def _moment(index: int, key: str, make: Callable[[torch.Tensor], Any]) -> Any:
    return lambda sd, o: sd["state"][index].__setitem__(key, make(sd["state"][index][key]))


def _param_0(make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return lambda o: o.param_groups[0]["params"].__setitem__(
        0, make(o.param_groups[0]["params"][0])
    )


def _overriding(method: str) -> Any:
    return lambda o: type("Sub", (FusedAdamStandIn,), {method: lambda self, *a: None})(_params(o))


def _on_instance(method: str) -> Any:
    """The class's own method set on the instance, as a wrapper sets one (a no-op if none)."""
    own = getattr(FusedAdamStandIn, method, None)
    return lambda o: setattr(o, method, types.MethodType(own, o) if own else lambda *a: None)


class _Tagged(torch.Tensor):
    """A tensor subclass, as DTensor or TE's QuantizedTensor are."""


def _overlapping_views(state_dict: Dict[str, Any], optimizer: Any) -> None:
    buffer = torch.zeros(7 + 33)
    state_dict["state"][2]["exp_avg"], state_dict["state"][3]["exp_avg"] = buffer[:7], buffer[6:39]


_P = pytest.param
DECLINES = [
    _P(_case(is_stub_optimizer=True), "the owner is a stub optimizer", id="stub owner"),
    _P(_case(config=None), "the owner's OptimizerConfig is unknown", id="config unknown"),
    _P(_case(config=config_with(optimizer_cpu_offload=True)), "optimizer_cpu_offload is set", id="CPU offload"),
    _P(_case(config=AWARE), "use_precision_aware_optimizer is set", id="precision-aware"),
    _P(_case(config=types.SimpleNamespace(optimizer_cpu_offload=False)),
       "SimpleNamespace has no 'use_precision_aware_optimizer'", id="config API drift"),
    _P(_case(adopter=lambda: TEFusedAdamFP32StateAdopter(device_type="cpu", te_version="2.20.2")),
       "Transformer Engine's FusedAdam is not loaded", id="TE not loaded"),
    _P(_case(opt=lambda o: torch.optim.Adam(_params(o))), "the inner optimizer is Adam, not FusedAdam",
       id="torch Adam"),
    *[_P(_case(opt=_overriding(m)), f"Sub overrides FusedAdam.{m}", id=f"overrides {m}") for m in STATE_METHODS],
    *[_P(_case(opt=_on_instance(m)), f"the FusedAdamStandIn instance has its own {m}", id=f"instance {m}")
      for m in STATE_METHODS],
    _P(_case(opt=lambda o: delattr(o, "master_weights")), "FusedAdam has no 'master_weights'", id="no master_weights"),
    _P(_case(opt=lambda o: fresh_standin(master_weights=True)), "FusedAdam.master_weights is set", id="master weights"),
    _P(_case(opt=lambda o: setattr(o, "store_param_remainders", True)), "FusedAdam.store_param_remainders is set",
       id="param remainders"),
    _P(_case(opt=lambda o: delattr(o, "name_to_dtype_map")), "FusedAdam has no 'name_to_dtype_map'", id="no dtype map"),
    _P(_case(opt=lambda o: setattr(o, "name_to_dtype_map", [])), "FusedAdam has no 'name_to_dtype_map'",
       id="dtype map a list"),
    _P(_case(opt=lambda o: fresh_standin(exp_avg_dtype=torch.bfloat16)),
       "FusedAdam keeps exp_avg in torch.bfloat16, not torch.float32", id="BF16 exp_avg"),
    _P(_case(opt=lambda o: fresh_standin(exp_avg_sq_dtype=torch.float16)),
       "FusedAdam keeps exp_avg_sq in torch.float16, not torch.float32", id="FP16 exp_avg_sq"),
    _P(_case(adopter=lambda: standin_adopter("cuda")), "parameter 0: is on cpu, not on cuda", id="not on cuda"),
    _P(_case(opt=_param_0(lambda p: torch.nn.Parameter(p.detach().bfloat16()))),
       "parameter 0: is torch.bfloat16, not torch.float32", id="BF16 parameter"),
    _P(_case(opt=_param_0(lambda p: p.detach().as_subclass(_Tagged))),
       "parameter 0: is a _Tagged, not a plain tensor or a DTensor of one", id="subclass parameter"),
    _P(_case(lambda sd, o: sd["param_groups"].pop()), "the state dict has 1 param groups, the optimizer 2",
       id="group count"),
    _P(_case(lambda sd, o: sd["param_groups"][0]["params"].pop()),
       "param group 0 has 1 params in the state dict, 2 in the optimizer", id="group size"),
    _P(_case(lambda sd, o: sd["param_groups"][1].pop("params")),
       "param group 1 of the state dict has no 'params' list", id="group without params"),
    _P(_case(lambda sd, o: sd.__setitem__("state", list(sd["state"].values()))),
       "the state dict lacks a 'state' mapping or a 'param_groups' list", id="state a list"),
    _P(_case(lambda sd, o: sd["state"].pop(3)), "parameter 3: has no incoming state", id="no entry"),
    _P(_case(lambda sd, o: sd["state"].__setitem__(99, sd["state"][0])),
       "the incoming state does not hold exactly one entry per parameter", id="entry for no parameter"),
    _P(_case(lambda sd, o: sd["state"][1].__setitem__("step", torch.tensor(2.0))),
       f"parameter 1: the incoming state has keys ['exp_avg', 'exp_avg_sq', 'step'], not {KEYS}",
       id="per-parameter step"),
    _P(_case(lambda sd, o: sd["state"][2].pop("exp_avg_sq")),
       f"parameter 2: the incoming state has keys ['exp_avg'], not {KEYS}", id="missing key"),
    _P(_case(lambda sd, o: sd["state"].__setitem__(0, [1])),
       f"parameter 0: the incoming state has keys list, not {KEYS}", id="entry a list"),
    *[_P(_case(_moment(0, "exp_avg", lambda t, d=d: t.to(d))),
         f"parameter 0: incoming exp_avg is {d}, not torch.float32", id=f"{d}")
      for d in (torch.bfloat16, torch.float16, torch.float64)],
    _P(_case(_moment(0, "exp_avg", lambda t: None)),
       "parameter 0: incoming exp_avg is a NoneType, not a plain torch.Tensor", id="None value"),
    _P(_case(_moment(1, "exp_avg_sq", lambda t: torch.empty(t.shape, device="meta"))),
       "parameter 1: incoming exp_avg_sq is on meta, the parameter on cpu", id="another device"),
    _P(_case(_moment(1, "exp_avg", torch.flatten)),
       "parameter 1: incoming exp_avg has shape (128,), the parameter (16, 8)", id="shape"),
    _P(_case(_moment(1, "exp_avg", lambda t: t.t().contiguous().t())),
       "parameter 1: incoming exp_avg is not contiguous", id="not contiguous"),
    _P(_case(_moment(0, "exp_avg", lambda t: t.requires_grad_())),
       "parameter 0: incoming exp_avg requires grad", id="requires grad"),
    _P(_case(_moment(0, "exp_avg", lambda t: t.as_subclass(_Tagged))),
       "parameter 0: incoming exp_avg is a _Tagged, not a plain torch.Tensor", id="subclass moment"),
    _P(_case(_moment(0, "exp_avg", lambda t: t.to_sparse())),
       "parameter 0: incoming exp_avg is quantized or has layout torch.sparse_coo", id="sparse"),
    _P(_case(lambda sd, o: sd["state"][0].__setitem__("exp_avg_sq", sd["state"][0]["exp_avg"])),
       "parameter 0: incoming exp_avg_sq overlaps incoming exp_avg", id="one tensor for both"),
    _P(_case(lambda sd, o: sd["state"][2].__setitem__("exp_avg", _params(o)[2].detach())),
       "parameter 2: incoming exp_avg overlaps parameter 2", id="a parameter's memory"),
    _P(_case(_overlapping_views), "parameter 3: incoming exp_avg overlaps incoming exp_avg",
       id="overlapping views"),
    _P(_case(owns_state_dict=False),
       "parameter 0: incoming exp_avg is the caller's tensor, not the held one: the caller may keep it",
       id="the caller's tensors"),
]  # fmt: skip
REASONS = {param.id: param.values for param in DECLINES}


@pytest.mark.parametrize("build, reason", DECLINES)
def test_each_rule_declines_with_its_reason_and_changes_nothing(build: Build, reason: str) -> None:
    adopter, context = build()
    assert adopter.decline_reason(context) == reason
    assert len(context.optimizer.state) == 0 and getattr(context.optimizer, "allocations", 0) == 0


@pytest.mark.parametrize(
    "case", ["master weights", "BF16 exp_avg", "one tensor for both", "stub owner", "param remainders",
             "the caller's tensors", "None value", "instance set_scaled_state"],
)  # fmt: skip
def test_declined_state_is_loaded_by_tes_loader_as_upstream(case: str) -> None:
    build, reason = REASONS[case]
    outcome = _load(*build())
    assert (outcome.adopter, outcome.method) == (None, "FusedAdamStandIn.load_state_dict")
    assert (
        outcome.declines == ((NAME, reason),)
        and outcome.fallback_reason == "every adopter declined"
    )
    (adopter, ours), (_, upstream) = build(), build()
    _load(adopter, ours)
    upstream.optimizer.load_state_dict(upstream.state_dict)
    assert ours.optimizer.allocations == upstream.optimizer.allocations > 0
    assert_bitwise_equal(state_tensors(ours.optimizer), state_tensors(upstream.optimizer))
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (
        0,
        sum(t.nbytes for t in state_tensors(ours.optimizer)),
    )


def test_a_per_parameter_step_reaches_tes_loader_which_fails_as_upstream() -> None:
    """MCore adds a per-parameter ``step`` without Apex/TE; TE's loader has no dtype for it."""
    build, reason = REASONS["per-parameter step"]
    _, upstream = build()
    with pytest.raises(KeyError) as raised:
        upstream.optimizer.load_state_dict(upstream.state_dict)
    adopter, context = build()
    registry, recorded = registry_of(adopter), []
    registry.register_outcome_hook(recorded.append)
    with pytest.raises(KeyError) as ours:
        load_inner_optimizer_state_dict(
            Owner(context.optimizer), context.state_dict, owns_state_dict=True, registry=registry
        )
    assert str(ours.value) == str(raised.value) == "'step'"
    (outcome,) = recorded
    assert outcome.error == "KeyError: 'step'" and outcome.declines == ((NAME, reason),)


UNKNOWN = "FusedAdam has no 'store_param_remainders' and the TE release is unknown"
TE_0 = "Transformer Engine 0.0.0 predates 1.13, the first release this adopter knows"


@pytest.mark.parametrize(
    "te_version, reason",
    [(v, None) for v in ("1.13.0.dev0", "1.13.0rc1", "1.14.0+abc", "2.0.0.post1", "2.0.0.dev0+cu12", "2.0.99")]
    + [(v, f"Transformer Engine {v} predates 1.13, the first release this adopter knows")
       for v in ("1.12.0", "1.12.0.post9", "0.0.0")]
    + [(v, f"FusedAdam has no 'store_param_remainders', which Transformer Engine {v} sets")
       for v in ("2.1.0.dev0", "2.1.0rc0", "2.1.0.dev0+d4a2b1c", "2.20.0", "3.0")]
    + [("banana", UNKNOWN), ("2.x", UNKNOWN), (None, TE_0)],
)  # fmt: skip
def test_without_the_remainder_attribute_the_te_release_decides(
    te_version: str, reason: Any
) -> None:
    """TE 1.13 to 2.0 (dev builds included) have no ``store_param_remainders``; from 2.1 on TE
    always sets it, and then the release does not matter. An invalid version is unknown; by
    default it is Megatron-Core's ``get_te_version()``, 0.0.0 without TE installed."""
    without = make_context(fresh_standin(te_release=(2, 0)), _payload(), owns_state_dict=True)
    assert standin_adopter(te_version=te_version).decline_reason(without) == reason
    with_it = make_context(fresh_standin(), _payload(), owns_state_dict=True)
    assert standin_adopter(te_version=te_version).decline_reason(with_it) is None


# --- Megatron-FSDP: DTensor state -----------------------------------------------------------

SHAPES = [(12,), (4, 3), (0,), (6,)]  # parameter 2's local shard is empty (uneven sharding)
EVEN = [shape for shape in SHAPES if shape != (0,)]
ELEMENTS = 12 + 12 + 0 + 6


def _dtensor(local: torch.Tensor, mesh: Any, placement: Any = None) -> DTensor:
    return DTensor.from_local(local, mesh, [placement or Shard(0)], run_check=False)


def _fsdp(mesh: Any, seed: int = 0, steps: int = 0, config: Any = None, shapes: Any = EVEN) -> Any:
    """The installed DistributedOptimizer (Megatron-FSDP) over DTensor parameters, after
    ``steps`` steps (no gradient for an empty shard: Megatron-FSDP gives it none)."""
    generator = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(_dtensor(torch.randn(s, generator=generator), mesh)) for s in shapes
    ]
    groups = [{"params": params[:2], **MCORE_PARAM_GROUP_KEYS},
              {"params": params[2:], **MCORE_PARAM_GROUP_KEYS, "wd_mult": 0.0}]  # fmt: skip
    inner = FusedAdamStandIn(groups, lr=1e-2, weight_decay=0.1)
    owner = CpuDistributedOptimizer(inner, config or config_with(), FSDP)
    owner.param_to_name = {
        p: f"layer.param{i}" for i, p in enumerate(params)
    }  # _param_name's cache
    for _ in range(steps):
        for param in params:
            if param.to_local().numel() > 0:
                param.grad = _dtensor(
                    torch.randn(param.to_local().shape, generator=generator), mesh
                )
        inner.step()
    return owner


def _locals(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _held(owner: Any) -> Dict[str, Any]:
    """What Megatron-FSDP hands the loader: the optimizer's own state entries, read in place."""
    return torch.optim.Optimizer.state_dict(owner.optimizer)


def test_dtensor_moments_are_installed_by_reference_bit_for_bit_as_te_loads_them(
    cpu_mesh: Any,
) -> None:
    adopted, by_te = _fsdp(cpu_mesh, steps=2), _fsdp(cpu_mesh, steps=2)
    incoming = _held(adopted)
    outcome = _load(standin_adopter(), AdoptionContext.for_owner(adopted, state_dict=incoming))
    assert (outcome.adopter, outcome.reused_bytes, outcome.allocated_bytes) == (
        NAME,
        8 * ELEMENTS,
        0,
    )
    for index, param in enumerate(_params(adopted.optimizer)):
        for key in MOMENTS:
            held = adopted.optimizer.state[param][key]
            assert held.to_local().data_ptr() == incoming["state"][index][key].to_local().data_ptr()
            assert isinstance(held, DTensor) and held.placements == param.placements
    own = _load(None, AdoptionContext.for_owner(by_te, state_dict=_held(by_te)))
    assert (own.reused_bytes, own.allocated_bytes) == (
        0,
        8 * ELEMENTS,
    )  # TE: a new local shard each
    for _ in range(2):  # after the load, then after the next step
        assert_bitwise_equal(
            _locals(state_tensors(adopted.optimizer)), _locals(state_tensors(by_te.optimizer))
        )
        assert_bitwise_equal(_locals(_params(adopted.optimizer)), _locals(_params(by_te.optimizer)))
        for owner in (adopted, by_te):
            for param in _params(owner.optimizer):
                param.grad = _dtensor(torch.ones(param.to_local().shape), cpu_mesh)
            owner.optimizer.step()


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda t, mesh: _dtensor(t.to_local(), mesh, Replicate()), "has another placements than the parameter"),
        (lambda t, mesh: t.to_local(), "is a Tensor, the parameter a DTensor"),
        (lambda t, mesh: _dtensor(t.to_local().double(), mesh), "is torch.float64, not torch.float32"),
        (lambda t, mesh: DTensor.from_local(t.to_local(), mesh, [Shard(0)], shape=(24,), stride=(1,)),
         "has another shape than the parameter"),
        (lambda t, mesh: _dtensor(t.to_local().clone(), mesh),
         "is the caller's tensor, not the held one: the caller may keep it"),
    ],
    ids=["placements", "a plain tensor", "FP64 local shard", "global shape", "a copy"],
)  # fmt: skip
def test_dtensor_state_laid_out_otherwise_is_declined_and_loaded_by_te(
    cpu_mesh: Any, change: Any, reason: str
) -> None:
    owner = _fsdp(cpu_mesh, steps=2)
    incoming = _held(owner)
    incoming["state"][0] = {
        **incoming["state"][0],
        "exp_avg": change(incoming["state"][0]["exp_avg"], cpu_mesh),
    }
    outcome = _load(standin_adopter(), AdoptionContext.for_owner(owner, state_dict=incoming))
    assert outcome.declines == ((NAME, f"parameter 0: incoming exp_avg {reason}"),)
    assert (
        outcome.method == "FusedAdamStandIn.load_state_dict"
        and outcome.allocated_bytes == 8 * ELEMENTS
    )


@pytest.mark.parametrize("without_entry", [False, True], ids=["empty moments", "no entry"])
def test_an_empty_local_shard_is_adopted_with_what_the_state_dict_has(
    cpu_mesh: Any, without_entry: bool
) -> None:
    """Uneven sharding: TE's step gave the empty shard empty moments, or a checkpoint has none."""
    owner = _fsdp(cpu_mesh, steps=2, shapes=SHAPES)
    incoming = _held(owner)
    assert incoming["state"][2]["exp_avg"].to_local().numel() == 0
    if without_entry:
        del incoming["state"][2]
    outcome = _load(standin_adopter(), AdoptionContext.for_owner(owner, state_dict=incoming))
    assert (outcome.adopter, outcome.declines, outcome.allocated_bytes) == (NAME, (), 0)
    assert (_params(owner.optimizer)[2] in owner.optimizer.state) is not without_entry


# --- the initialize role: Megatron-FSDP's state for a checkpoint to be read into ----------


def _initialize(owner: Any, *adopters: Any, own: Any = None) -> AdoptionOutcome:
    registry, own = registry_of(*adopters), own or owner._init_optimizer_states_with_dummy_values
    return outcome_of(
        registry, lambda: initialize_inner_optimizer_state(owner, own, registry=registry, steps=True)
    )


def test_the_created_state_is_the_dummy_steps_in_one_allocation(cpu_mesh: Any) -> None:
    """The moments are views of one allocation, each on a 512-byte boundary (the allocator's
    block alignment), so no moment has a segment of its own for the allocator to round up."""
    ours, own = _fsdp(cpu_mesh, shapes=SHAPES), _fsdp(cpu_mesh, shapes=SHAPES)
    created = _initialize(ours, standin_adopter())
    assert (created.adopter, created.allocated_bytes, created.reused_bytes) == (
        NAME,
        8 * ELEMENTS,
        0,
    )
    moments = _locals(state_tensors(ours.optimizer))
    assert len({m.untyped_storage().data_ptr() for m in moments}) == 1
    assert sorted(m.storage_offset() * 4 % 512 for m in moments) == [0] * len(moments)
    assert [p.grad for p in _params(ours.optimizer)] == [None] * len(SHAPES)
    dummy = _initialize(own)
    assert dummy.method == "DistributedOptimizer._init_optimizer_states_with_dummy_values"
    keys = [[sorted(o.optimizer.state[p]) for p in _params(o.optimizer)] for o in (ours, own)]
    assert keys[0] == keys[1]
    assert_bitwise_equal(
        _locals(state_tensors(ours.optimizer)), _locals(state_tensors(own.optimizer))
    )
    for param in _params(ours.optimizer):
        assert all(isinstance(v, DTensor) and v.placements == param.placements
                   for v in ours.optimizer.state[param].values())  # fmt: skip
    assert (
        [g["step"] for g in ours.optimizer.param_groups]
        == [g["step"] for g in own.optimizer.param_groups]
        == [1, 1]
    )


MIB = 1 << 20


def _held_by_the_allocator(size: int) -> int:
    """What the CUDA caching allocator's block of a new allocation of ``size`` bytes (a multiple
    of 512) holds: from 10 MiB on, a segment of its own rounded up to 2 MiB, kept whole where
    1 MiB or less is left over; below that, a split block of ``size``."""
    segment = -(-size // (2 * MIB)) * 2 * MIB
    return segment if size >= 10 * MIB and segment - size <= MIB else size


# Qwen2.5-0.5B's FP32 moments on one rank, per parameter of its 24 layers and the embedding (512-byte
# blocks): linear_qkv's weight and bias, linear_proj, linear_fc1 and fc2, two norms; the final norm.
QWEN_MOMENTS = 2 * ([1152 * 896 * 4, 1152 * 4, 896 * 896 * 4, 9728 * 896 * 4, 896 * 4864 * 4,
                     896 * 4, 896 * 4] * 24 + [151936 * 896 * 4, 896 * 4])  # fmt: skip
SIZES = {
    "Qwen2.5-0.5B": QWEN_MOMENTS,
    "keeps no remainder": [4 * MIB] * 3,
    "one large size overshoots": [3 * MIB, 8 * MIB + MIB // 2],
    "small in all": [512] * 9,
}


@pytest.mark.parametrize("name", SIZES)
def test_the_moments_allocations_leave_the_allocator_no_remainder_it_keeps(name: str) -> None:
    """Qwen2.5-0.5B's moments in one allocation would hold 0.83 MiB more than they need: the
    smallest go to a second allocation and neither does. Where one allocation keeps nothing, or
    a large size would overshoot, there is one."""
    sizes = sorted(-(-size // 512) * 512 for size in SIZES[name])
    tail = allocation._tail_length(sizes)
    held = [_held_by_the_allocator(sum(part)) for part in (sizes[:tail], sizes[tail:]) if part]
    one = _held_by_the_allocator(sum(sizes))
    assert (tail > 0) == (name == "Qwen2.5-0.5B")
    assert sum(held) == (sum(sizes) if name != "one large size overshoots" else one)
    assert name != "one large size overshoots" or one > sum(sizes)
    if name == "Qwen2.5-0.5B":
        assert one - sum(sizes) == 869_376  # the 0.83 MiB the GPU run's allocator records show


def _resume(owner: Any, checkpoint: Any) -> None:
    """Megatron-LM's fsdp_dtensor load: build the sharded state dict for loading, read the
    checkpoint into it in place (only the group keys it has), then ``load_state_dict``."""
    state_dict = owner.sharded_param_state_fsdp_dtensor(is_loading=True)
    saved = checkpoint.sharded_param_state_fsdp_dtensor(is_loading=False)
    with torch.no_grad():
        for param, source in zip(_params(owner.optimizer), _params(checkpoint.optimizer)):
            param.to_local().copy_(source.to_local())
        for name, entry in state_dict["state"].items():
            for key, value in entry.items():
                value.to_local().copy_(saved["state"][name][key].to_local())
    for name, meta in state_dict["param_to_group_meta"].items():
        meta.update({key: saved["param_to_group_meta"][name][key] for key in meta})
    owner.load_state_dict(state_dict)


@pytest.mark.usefixtures("standin_in_default_registry")
def test_a_resume_through_the_initialization_equals_the_own_path_bit_for_bit(
    cpu_mesh: Any, outcomes: List[AdoptionOutcome]
) -> None:
    """Through the installed DistributedOptimizer's methods; the own path is the same resume with
    ``OptimizerConfig.optimizer_state_adoption=False``, which reports no outcome (upstream's path
    exactly). Equal after it and after the next step."""
    checkpoint = _fsdp(cpu_mesh, seed=0, steps=2)
    ours, own = _fsdp(cpu_mesh, seed=1), _fsdp(
        cpu_mesh, seed=1, config=config_with(optimizer_state_adoption=False)
    )
    _resume(ours, checkpoint)
    _resume(own, checkpoint)
    standin = "te_fused_adam_fp32_standin"
    assert [(o.hook_point, o.adopter) for o in outcomes] == [("initialize", standin), ("load", standin)]
    assert (
        [g["step"] for g in ours.optimizer.param_groups]
        == [g["step"] for g in own.optimizer.param_groups]
        == [2, 2]
    )
    for _ in range(2):
        assert_bitwise_equal(
            _locals(state_tensors(ours.optimizer)), _locals(state_tensors(own.optimizer))
        )
        assert_bitwise_equal(_locals(_params(ours.optimizer)), _locals(_params(own.optimizer)))
        for owner in (ours, own):
            for param in _params(owner.optimizer):
                param.grad = _dtensor(torch.full(param.to_local().shape, -0.25), cpu_mesh)
            owner.optimizer.step()


def _bf16_param_3(owner: Any) -> None:
    mesh = _params(owner.optimizer)[0].device_mesh
    owner.optimizer.param_groups[1]["params"][1] = torch.nn.Parameter(
        _dtensor(torch.zeros(6).bfloat16(), mesh)
    )


def _grad(index: int, attribute: str = "grad") -> Any:
    return lambda o: setattr(
        _params(o.optimizer)[index], attribute, torch.zeros_like(_params(o.optimizer)[index])
    )


GRADIENT = "a parameter has a gradient, which a step would apply"
INITIALIZE = [
    _P(lambda o: setattr(o, "config", AWARE), "use_precision_aware_optimizer is set", id="precision-aware"),
    _P(lambda o: setattr(o.optimizer, "master_weights", True), "FusedAdam.master_weights is set", id="master weights"),
    _P(lambda o: o.optimizer.name_to_dtype_map.update(exp_avg=torch.bfloat16),
       "FusedAdam keeps exp_avg in torch.bfloat16, not torch.float32", id="BF16 moments"),
    _P(lambda o: setattr(o, "optimizer", _overriding("step")(o.optimizer)), "Sub overrides FusedAdam.step",
       id="a subclass overriding step"),
    _P(_bf16_param_3, "parameter 3: is torch.bfloat16, not torch.float32", id="BF16 parameter"),
]  # fmt: skip
GATES = [
    _P(lambda o: o.optimizer.initialize_state(_params(o.optimizer)[0]),
       "the optimizer holds state already, which the own initialization keeps", id="state held"),
    _P(_grad(1), GRADIENT, id="a gradient"),
    _P(_grad(3, "decoupled_grad"), GRADIENT, id="a decoupled gradient"),
]  # fmt: skip


@pytest.mark.parametrize("change, reason", INITIALIZE + GATES)
def test_each_initialize_rule_runs_the_own_initialization_once(
    cpu_mesh: Any, change: Any, reason: str
) -> None:
    owner = _fsdp(cpu_mesh, shapes=SHAPES)
    change(owner)
    ran: List[int] = []
    outcome = _initialize(owner, standin_adopter(), own=lambda: ran.append(1))
    assert ran == [1] and outcome.adopter is None
    if any(reason == p.values[1] for p in INITIALIZE):
        assert (
            outcome.declines == ((NAME, reason),)
            and outcome.fallback_reason == "every adopter declined"
        )
    else:
        assert outcome.declines == () and outcome.fallback_reason == reason
