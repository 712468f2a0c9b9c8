"""The opt-in precision-aware adopter (``te_fused_adam_precision_aware``) against TE's own code.

Each role is compared with what TE FusedAdam's own method gives, reproduced on the CPU by
``FusedAdamStandIn`` (BF16 moments upcast and copied back, master weights in FP32 or as int16
remainders, ``_scales``): the scaffold load (MCore's pass 1) installs by reference with TE's
scales of one; the payload load (pass 2) stores into the held state what TE's loader stores,
bit for bit; the export is the held tensors; the read targets are the held BF16 moments. On the
CPU, MCore's OptimizerConfig refuses the precision-aware flag, so the owner's config is a
namespace with the flags read (``mcore_owners.precision_aware_config``).
"""

import types
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from builders import (
    Owner,
    assert_bitwise_equal,
    make_params,
    make_standin,
    outcome_of,
    precision_aware_adopter,
    registry_of,
    state_tensors,
)
from fused_adam_standin import FusedAdamStandIn
from mcore_owners import (
    CpuPrecisionAwareDistributedOptimizer,
    precision_aware_config,
    precision_aware_owner,
)

from megatron.core.optimizer.state_adoption import (
    AdoptionContext,
    AdoptionOutcome,
    export_inner_optimizer_state_dict,
    initialize_inner_optimizer_state,
    load_inner_optimizer_state_dict,
    reading_optimizer_state,
)
from megatron.core.optimizer.state_adoption import TEFusedAdamPrecisionAwareStateAdopter

NAME = "te_fused_adam_precision_aware"
BF16 = torch.bfloat16
MODES: Dict[str, Dict[str, Any]] = {
    "BF16 params, int16 remainders": dict(
        dtype=BF16, master_weights=True, store_param_remainders=True
    ),
    "BF16 params, FP32 master weights": dict(dtype=BF16, master_weights=True),
    "FP32 params, no master weights": dict(dtype=torch.float32, master_weights=False),
}
WITH_MASTER = [mode for mode in MODES if MODES[mode]["master_weights"]]  # MCore's always has them
ELEMENTS = 64 + 128 + 7 + 33
NAN_BITS = [0x7F81, -0x3F, 0x7F80, -0x8000]  # NaNs with payloads, inf, -0.0


def _optimizer(mode: str, **changes: Any) -> FusedAdamStandIn:
    kwargs = {**MODES[mode], **changes}
    params = make_params(0, kwargs.pop("dtype"))
    return make_standin(params, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16, **kwargs)


def _params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _scaffold(optimizer: FusedAdamStandIn, seed: int = 1) -> Dict[str, Any]:
    """MCore's pass-1 state dict: new tensors in the dtypes TE keeps (here with random values,
    not ``torch.empty``'s), the checkpoint's group hyper-parameters."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for index, param in enumerate(_params(optimizer)):
        entry = {
            key: torch.rand(param.shape, generator=generator).to(BF16)
            for key in ("exp_avg", "exp_avg_sq")
        }
        if optimizer.master_weights:
            if optimizer.store_param_remainders and param.dtype == BF16:
                entry["master_param"] = torch.randint(
                    -(2**15), 2**15, param.shape, generator=generator
                ).short()
            else:
                entry["master_param"] = torch.rand(param.shape, generator=generator)
        state[index] = entry
    groups = [
        dict(group, step=7) for group in torch.optim.Optimizer.state_dict(optimizer)["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def _loaded(mode: str, seed: int = 1, nan: Optional[int] = None) -> FusedAdamStandIn:
    """An optimizer holding state as TE's loader leaves it after pass 1 and the read; ``nan``
    writes raw BF16 bits (NaNs with payloads, inf, -0.0) into that parameter's ``exp_avg``."""
    optimizer = _optimizer(mode)
    optimizer.load_state_dict(_scaffold(optimizer, seed))
    if nan is not None:
        held = optimizer.state[_params(optimizer)[nan]]["exp_avg"].view(torch.int16)
        held[: len(NAN_BITS)] = torch.tensor(NAN_BITS, dtype=torch.int16)
    return optimizer


def _owner(optimizer: torch.optim.Optimizer) -> Owner:
    return Owner(optimizer, config=precision_aware_config())


def _load(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> AdoptionOutcome:
    """Load as DistributedOptimizer's main branch does (it owns both passes' state dicts)."""
    registry = registry_of(precision_aware_adopter())
    return outcome_of(registry, lambda: load_inner_optimizer_state_dict(
        _owner(optimizer), state_dict, owns_state_dict=True, registry=registry))  # fmt: skip


def _held(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [t for p in _params(optimizer) for t in optimizer.state[p].values()]


def _scales(optimizer: FusedAdamStandIn) -> List[Dict[str, List[float]]]:
    return [
        {k: v.tolist() for k, v in optimizer._scales.get(p, {}).items()} for p in _params(optimizer)
    ]


@pytest.mark.parametrize("mode", MODES)
def test_the_scaffold_is_installed_by_reference_with_tes_scales_of_one(mode: str) -> None:
    adopted, by_te = _optimizer(mode), _optimizer(mode)
    scaffold = _scaffold(adopted)
    outcome = _load(adopted, scaffold)
    by_te.load_state_dict(_scaffold(by_te))
    per_element = {"BF16 params, int16 remainders": 6, "BF16 params, FP32 master weights": 8}.get(
        mode, 4
    )
    assert (outcome.adopter, outcome.reused_bytes, outcome.allocated_bytes) == (
        NAME,
        per_element * ELEMENTS,
        0,
    )
    assert adopted.allocations == 0 and by_te.allocations > 0  # TE allocated every tensor again
    assert all(
        a is b
        for a, b in zip(_held(adopted), [t for e in scaffold["state"].values() for t in e.values()])
    )
    assert_bitwise_equal(state_tensors(adopted), state_tensors(by_te))
    assert _scales(adopted) == _scales(by_te) and all(
        s == {"exp_avg": [1.0], "exp_avg_sq": [1.0]} for s in _scales(adopted)
    )
    assert (
        [g["step"] for g in adopted.param_groups]
        == [g["step"] for g in by_te.param_groups]
        == [7, 7]
    )
    assert [p.dtype for p in _params(adopted)] == [MODES[mode]["dtype"]] * 4


@pytest.mark.parametrize("mode", MODES)
def test_the_initialization_is_tes_own_in_one_allocation_per_dtype(mode: str) -> None:
    """The state a checkpoint is read into is what TE's ``initialize_state`` creates, bit for
    bit (zeroed BF16 moments, zeroed int16 remainders or FP32 master weights copied from the
    parameter, scales of one), with the tensors of each dtype views of one allocation."""
    ours, by_te = _optimizer(mode), _optimizer(mode)
    registry = registry_of(precision_aware_adopter())
    outcome = outcome_of(registry, lambda: initialize_inner_optimizer_state(
        _owner(ours), registry=registry))  # fmt: skip
    for param in _params(by_te):
        by_te.initialize_state(param, by_te.store_param_remainders and param.dtype == BF16)
    assert (outcome.hook_point, outcome.adopter) == ("initialize", NAME)
    assert [sorted(ours.state[p]) for p in _params(ours)] == [
        sorted(by_te.state[p]) for p in _params(by_te)
    ]
    assert_bitwise_equal(state_tensors(ours), state_tensors(by_te))
    assert _scales(ours) == _scales(by_te)
    held = _held(ours)
    assert len({t.untyped_storage().data_ptr() for t in held}) == len({t.dtype for t in held})
    assert ours.allocations == 0 and all("step" not in g for g in ours.param_groups)


def _export(optimizer: FusedAdamStandIn) -> Dict[str, Any]:
    """The adopter's export (what MCore's pass 2 hands back): the held tensors, new containers."""
    state_dict = torch.optim.Optimizer.state_dict(optimizer)
    return dict(state_dict, state={k: dict(e) for k, e in state_dict["state"].items()})


def _with_moments_of(state_dict: Dict[str, Any], other: FusedAdamStandIn) -> Dict[str, Any]:
    """``state_dict`` with ``other``'s FP32 moments (TE's master weights are read in place)."""
    for entry, theirs in zip(state_dict["state"].values(), other.state_dict()["state"].values()):
        entry.update(exp_avg=theirs["exp_avg"], exp_avg_sq=theirs["exp_avg_sq"])
    return state_dict


@pytest.mark.parametrize("mode", MODES)
def test_the_payload_of_the_held_tensors_is_kept_as_tes_loader_leaves_it(mode: str) -> None:
    """MCore's pass 2 hands back the state it read into (the export: the held tensors): kept,
    nothing written, bit for bit what TE's loader (which allocates it all again) leaves."""
    adopted, by_te = _loaded(mode), _loaded(mode)
    held, allocations = _held(adopted), adopted.allocations
    versions = [tensor._version for tensor in held]
    outcome = _load(adopted, _export(adopted))
    by_te.load_state_dict(_export(by_te))
    measured = (outcome.adopter, outcome.reused_bytes, outcome.allocated_bytes)
    assert measured == (NAME, sum(t.nbytes for t in held), 0)
    assert all(a is b for a, b in zip(_held(adopted), held)) and adopted.allocations == allocations
    assert [tensor._version for tensor in held] == versions
    assert by_te.allocations > allocations
    assert_bitwise_equal(state_tensors(adopted), state_tensors(by_te))
    assert _scales(adopted) == _scales(by_te)


@pytest.mark.parametrize("nan", [0, -1], ids=["first parameter", "last parameter"])
@pytest.mark.parametrize("mode", MODES)
def test_a_payload_holding_a_nan_is_left_to_tes_loader_which_makes_it_canonical(
    mode: str, nan: int
) -> None:
    """TE's loader turns every BF16 state into ``.float().bfloat16()``, which changes only NaN
    payloads: a NaN in any tensor, beside an inf, declines, and TE's own loader runs."""
    adopted, by_te = _loaded(mode, nan=nan), _loaded(mode, nan=nan)
    outcome = _load(adopted, _export(adopted))
    by_te.load_state_dict(_export(by_te))
    assert (outcome.adopter, outcome.method) == (None, "FusedAdamStandIn.load_state_dict")
    assert dict(outcome.declines)[NAME] == (
        "the incoming BF16 state holds a NaN, which TE's loader makes canonical"
    )
    assert_bitwise_equal(state_tensors(adopted), state_tensors(by_te))
    held = adopted.state[_params(adopted)[nan]]["exp_avg"]
    assert held[:2].isnan().all() and held[2:4].view(torch.int16).tolist() == [0x7F80, -0x8000]


@pytest.mark.parametrize(
    "payload",
    [
        lambda o, mode: o.state_dict(),
        lambda o, mode: _with_moments_of(o.state_dict(), _loaded(mode, 9)),
    ],
    ids=["TE's state_dict (FP32 copies)", "another run's FP32 moments"],
)
@pytest.mark.parametrize("mode", MODES)
def test_a_payload_of_other_tensors_is_left_to_tes_loader(mode: str, payload: Any) -> None:
    """Only the held state itself is kept (what MCore hands back after this adopter's export);
    FP32 values (the export declined, or another run's) go to TE's own loader: upstream's path."""
    adopted, by_te = _loaded(mode), _loaded(mode)
    outcome = _load(adopted, payload(adopted, mode))
    by_te.load_state_dict(payload(by_te, mode))
    assert (outcome.adopter, outcome.method) == (None, "FusedAdamStandIn.load_state_dict")
    assert_bitwise_equal(state_tensors(adopted), state_tensors(by_te))


@pytest.mark.parametrize("mode", MODES)
def test_the_export_is_the_held_tensors_and_loads_as_tes_state_dict(mode: str) -> None:
    optimizer, by_te = _loaded(mode), _loaded(mode)
    registry = registry_of(precision_aware_adopter())
    exported: List[Dict[str, Any]] = []
    outcome = outcome_of(
        registry,
        lambda: exported.append(export_inner_optimizer_state_dict(_owner(optimizer), registry)),
    )
    held = _held(optimizer)
    assert (outcome.adopter, outcome.reused_bytes, outcome.allocated_bytes) == (
        NAME,
        sum(t.nbytes for t in held),
        0,
    )
    assert [
        t for e in exported[0]["state"].values() for t in e.values()
    ] == held  # the held tensors themselves
    assert all(
        a is b for a, b in zip([t for e in exported[0]["state"].values() for t in e.values()], held)
    )
    none = registry_of()
    own = outcome_of(none, lambda: export_inner_optimizer_state_dict(_owner(by_te), none))
    assert (own.method, own.allocated_bytes) == (
        "FusedAdamStandIn.state_dict",
        4 * 2 * ELEMENTS,
    )  # FP32 copies
    assert exported[0]["param_groups"] == by_te.state_dict()["param_groups"]
    optimizer.load_state_dict(exported[0])
    by_te.load_state_dict(by_te.state_dict())
    assert_bitwise_equal(state_tensors(optimizer), state_tensors(by_te))


def _read_resume(owner: Any, registry: Any) -> List[Dict[str, torch.Tensor]]:
    """A precision-aware ``dp_reshardable`` resume through the installed DistributedOptimizer's
    own methods: build the targets, read FP32 (int16) checkpoint values into them as
    ``torch_dist`` does (``copy_`` with its cast), store them."""
    generator = torch.Generator().manual_seed(4)
    params = _params(owner.optimizer)
    with reading_optimizer_state(owner, True, registry=registry):
        targets = [owner._get_main_param_and_optimizer_states(p) for p in params]
    for tensors in targets:
        for target in tensors.values():
            if target.dtype == torch.int16:
                target.copy_(torch.randint(-(2**15), 2**15, target.shape, generator=generator))
            else:
                target.copy_(torch.randn(target.shape, generator=generator) / 7)
    for param, tensors in zip(params, targets):
        owner._set_main_param_and_optimizer_states(param, tensors)
    return targets


def _read_owner(mode: str) -> CpuPrecisionAwareDistributedOptimizer:
    """The state MCore's ``init_state_fn`` creates before the read (TE's ``initialize_state``)."""
    return precision_aware_owner(_optimizer(mode))


@pytest.mark.parametrize("mode", WITH_MASTER)
def test_the_read_targets_are_the_held_moments_and_the_state_after_the_store_is_upstreams(
    mode: str,
) -> None:
    owner, upstream = _read_owner(mode), _read_owner(mode)
    held, allocations = [
        dict(owner.optimizer.state[p]) for p in _params(owner.optimizer)
    ], owner.optimizer.allocations
    registry = registry_of(precision_aware_adopter())
    targets: List[Any] = []
    outcome = outcome_of(registry, lambda: targets.extend(_read_resume(owner, registry)), "read")
    for tensors, entry in zip(targets, held):
        assert (
            tensors["exp_avg"] is entry["exp_avg"] and tensors["exp_avg_sq"] is entry["exp_avg_sq"]
        )
        assert tensors["param"].data_ptr() == entry["master_param"].data_ptr()  # TE's own target
    assert (outcome.adopter, outcome.allocated_bytes) == (NAME, 0)
    assert owner.optimizer.allocations == allocations
    none = registry_of()
    own = outcome_of(none, lambda: _read_resume(upstream, none), "read")
    assert (own.method, own.allocated_bytes) == (
        "FusedAdamStandIn.get_unscaled_state",
        4 * 2 * ELEMENTS,
    )
    assert_bitwise_equal(state_tensors(owner.optimizer), state_tensors(upstream.optimizer))


# --- every decline rule, by its reason ------------------------------------------------------

MODE = "BF16 params, int16 remainders"
ROLES = {  # the optimizer each role is asked about, and the state dict a load is given
    "scaffold": lambda: (lambda o: (o, _scaffold(o)))(_optimizer(MODE)),
    "payload": lambda: (lambda o: (o, _export(o)))(_loaded(MODE)),
    "export": lambda: (_loaded(MODE), None),
    "read": lambda: (precision_aware_owner(_optimizer(MODE)).optimizer, None),
}
CHECKS = {"scaffold": "decline_reason", "payload": "decline_reason", "export": "export_decline_reason",
          "read": "read_target_decline_reason"}  # fmt: skip


class _Tagged(torch.Tensor):
    """A tensor subclass, as TE's QuantizedTensor is."""


def _entry(index: int, key: str, make: Callable[[Any], Any]) -> Callable[[Any], None]:
    return lambda c: c.sd["state"][index].__setitem__(key, make(c))


def _param(index: int, make: Callable[[torch.Tensor], Any]) -> Callable[[Any], None]:
    def change(c: Any) -> None:
        group, order = (0, index) if index < 2 else (1, index - 2)
        c.o.param_groups[group]["params"][order] = make(c.o.param_groups[group]["params"][order])

    return change


def _state(c: Any, index: int) -> Dict[str, torch.Tensor]:
    return c.o.state[_params(c.o)[index]]


def _sub(c: Any) -> None:
    c.o = type("Sub", (FusedAdamStandIn,), {"set_scaled_state": lambda self, *a: None})(
        _params(c.o)
    )


# a payload failing the held rules is still a valid scaffold (installed by reference as TE's
# loader would copy it), so those rules decline the export and the read targets
ALL, HELD = ("scaffold", "payload", "export", "read"), ("export", "read")
RULES = [  # (roles, change of c.o / c.sd / c.config / c.owns, reason)
    (ALL, lambda c: setattr(c, "config", precision_aware_config(use_precision_aware_optimizer=False)),
     "use_precision_aware_optimizer is not set", "FP32 owner"),
    (ALL, lambda c: setattr(c, "config", precision_aware_config(optimizer_cpu_offload=True)),
     "optimizer_cpu_offload is set", "CPU offload"),
    (ALL, lambda c: setattr(c, "o", torch.optim.Adam(_params(c.o))), "the inner optimizer is Adam, not FusedAdam",
     "torch Adam"),
    (ALL, _sub, "Sub overrides FusedAdam.set_scaled_state", "a subclass"),
    (ALL, lambda c: delattr(c.o, "_scales"), "FusedAdam has no '_scales'", "no _scales"),
    (ALL, lambda c: c.o.name_to_dtype_map.update(exp_avg=torch.float32), "FusedAdam keeps exp_avg in torch.float32",
     "FP32 moments"),
    (ALL, lambda c: c.o.name_to_dtype_map.update(exp_avg_sq=torch.float16),
     "FusedAdam keeps exp_avg_sq in torch.float16", "FP16 moments"),
    (ALL, lambda c: c.o.name_to_dtype_map.update(master_param=BF16), "FusedAdam keeps master_param in torch.bfloat16",
     "BF16 master weights"),
    (ALL, _param(1, lambda p: p.detach().as_subclass(_Tagged)), "a parameter is a _Tagged, not a plain tensor",
     "a subclass parameter"),
    (ALL, _param(2, lambda p: torch.nn.Parameter(p.detach().short(), requires_grad=False)),
     "a parameter is torch.int16 on cpu", "an integer parameter"),
    (("scaffold",), _entry(0, "exp_avg", lambda c: c.sd["state"][0]["exp_avg"].float()),
     "no payload (the optimizer holds no state yet), no scaffold (parameter 0: incoming exp_avg is torch.float32, "
     "not torch.bfloat16)", "FP32 scaffold moment"),
    (("scaffold",), lambda c: c.sd["state"][1].pop("master_param"),
     "parameter 1: the incoming state has keys ['exp_avg', 'exp_avg_sq'], not", "no master weights"),
    (("scaffold",), _entry(2, "master_param", lambda c: c.sd["state"][2]["master_param"].float()),
     "parameter 2: incoming master_param is torch.float32, not torch.int16", "FP32 for remainders"),
    (("scaffold",), lambda c: setattr(c, "owns", False),
     "parameter 0: incoming exp_avg is the caller's tensor, not the held one", "the caller's scaffold"),
    (("payload",), _entry(0, "exp_avg_sq", lambda c: c.sd["state"][0]["exp_avg_sq"].float()),
     "no payload (the incoming state[0]['exp_avg_sq'] is not the held tensor), no scaffold (",
     "an FP32 copy (TE's state_dict)"),
    (("payload",), _entry(1, "exp_avg", lambda c: c.sd["state"][1]["exp_avg"].flatten()),
     "the incoming state[1]['exp_avg'] is not the held tensor", "payload shape"),
    (("payload",), lambda c: c.sd["state"][1].pop("master_param"),
     "the incoming state[1] is not a dict of 3 items as held", "payload key missing"),
    (("payload",), _entry(2, "exp_avg", lambda c: _state(c, 0)["exp_avg"][:14].view(torch.float32)),
     "the incoming state[2]['exp_avg'] is not the held tensor", "payload in held memory"),
    (HELD, lambda c: c.o.state.clear(), "the optimizer holds no state yet", "no held state"),
    (HELD, lambda c: c.o._scales[_params(c.o)[0]]["exp_avg"].fill_(2.0),
     "a scale of the held BF16 state is not one", "a scale of two"),
    (HELD, lambda c: c.o.state.pop(_params(c.o)[2]), "the held state: parameter 2: has no state",
     "a parameter without held state"),
    (HELD, lambda c: _state(c, 1).__setitem__("exp_avg", _state(c, 1)["exp_avg"].float()),
     "the held state: parameter 1: exp_avg is torch.float32, not torch.bfloat16", "an FP32 held moment"),
    (("read",), lambda c: c.o.param_groups[1].__setitem__("step", 3),
     "a param group has stepped: its held state may be trained state", "after a step"),
]  # fmt: skip


@pytest.mark.parametrize(
    "role, change, reason",
    [
        pytest.param(role, change, reason, id=f"{role}: {name}")
        for roles, change, reason, name in RULES
        for role in roles
    ],
)
def test_each_rule_declines_by_its_reason_and_changes_nothing(
    role: str, change: Any, reason: str
) -> None:
    optimizer, state_dict = ROLES[role]()
    case = types.SimpleNamespace(
        o=optimizer, sd=state_dict, config=precision_aware_config(), owns=True
    )
    change(case)
    before = {id(p): {k: id(v) for k, v in e.items()} for p, e in case.o.state.items()}
    context = AdoptionContext(
        optimizer=case.o, config=case.config, state_dict=case.sd, owns_state_dict=case.owns
    )
    answer = getattr(precision_aware_adopter(), CHECKS[role])(context)
    assert answer is not None and reason in answer, answer
    assert {id(p): {k: id(v) for k, v in e.items()} for p, e in case.o.state.items()} == before


@pytest.mark.parametrize("mode", MODES)
def test_a_scaffold_of_uninitialized_memory_is_installed_even_where_its_bits_read_as_nan(
    mode: str,
) -> None:
    """MCore builds the scaffold with ``torch.empty`` and reads the checkpoint into it afterwards
    (the read targets are the installed tensors): whatever bits it holds, NaN patterns included,
    it is installed by reference, not left to TE's loader."""
    adopted = _optimizer(mode)
    scaffold = _scaffold(adopted)
    for entry in scaffold["state"].values():
        entry["exp_avg"].view(torch.int16).view(-1)[:3] = torch.tensor([0x7F81, -0x7F, 0x7FFF])  # NaNs
    outcome = _load(adopted, scaffold)
    assert outcome.adopter == NAME and outcome.allocated_bytes == 0
    assert all(
        a is b
        for a, b in zip(_held(adopted), [t for e in scaffold["state"].values() for t in e.values()])
    )


def test_an_opt_in_that_is_no_bool_declines_by_name() -> None:
    """``precision_aware_optimizer_state_adoption="false"`` (a mistyped switch) is no opt-in."""
    adopter = TEFusedAdamPrecisionAwareStateAdopter(
        FusedAdamStandIn, "cpu", "2.20.2", name="bf16", requires_config_opt_in=True
    )
    optimizer = _optimizer(next(iter(MODES)))
    context = AdoptionContext(
        optimizer=optimizer,
        config=types.SimpleNamespace(precision_aware_optimizer_state_adoption="false"),  # type: ignore[arg-type]
        state_dict=_scaffold(optimizer),
        owns_state_dict=True,
    )
    reason = "OptimizerConfig.precision_aware_optimizer_state_adoption is 'false', not True or False"
    assert adopter.decline_reason(context) == reason
