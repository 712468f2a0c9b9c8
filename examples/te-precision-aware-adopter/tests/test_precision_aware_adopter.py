"""The opt-in precision-aware adopter against TE's loader, reproduced by the CPU stand-in.

TE cannot load without a GPU: ``FusedAdamStandIn`` (tests/fused_adam_standin.py of the
main repository) reproduces FusedAdam's precision-aware loading — BF16 moments upcast and
copied back, master weights in FP32 or as int16 remainders, ``_scales`` — and
``initialize_state``. On CPU, MCore's OptimizerConfig refuses the precision-aware flag
without TE, so the owner config here is a namespace with the two flags the adopter reads.

Only public names of ``megatron.core.optimizer.state_adoption`` are used: loads and exports
run through the loader functions with an isolated ``StateAdopterRegistry(entry_point_group=None)``
passed as ``registry=``.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
import types
from importlib.metadata import PackageNotFoundError, distribution, distributions
from pathlib import Path
from typing import Any, Dict, List, Optional

from packaging.requirements import Requirement

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from fused_adam_standin import FusedAdamStandIn  # noqa: E402

TEFusedAdamPrecisionAwareStateAdopter = pytest.importorskip(
    "mcore_te_precision_aware_adopter",
    reason="the plugin is not installed (pip install examples/te-precision-aware-adopter)",
).TEFusedAdamPrecisionAwareStateAdopter

from megatron.core.distributed.distributed_data_parallel_config import (  # noqa: E402
    DistributedDataParallelConfig,
)
from megatron.core.optimizer.state_adoption import (  # noqa: E402
    StateAdopterRegistry,
    StateAdoptionContext,
    StateAdoptionOutcome,
    StateExportContext,
    export_inner_optimizer_state_dict,
    load_inner_optimizer_state_dict,
    reading_optimizer_state,
    registered_state_adopters,
)
from megatron.core.optimizer.state_adoption.testing import (  # noqa: E402
    assert_adoption_matches_own_loader,
    assert_check_is_side_effect_free,
    assert_export_matches_own_state_dict,
)
from megatron.core.optimizer.state_adoption.validation import (  # noqa: E402
    exported_state_dict_decline_reason,
)

PLUGIN_ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "mcore-te-precision-aware-adopter"
PACKAGE = "mcore_te_precision_aware_adopter"
ADOPTER_NAME = "te_fused_adam_precision_aware"

PRECISION_AWARE = types.SimpleNamespace(use_precision_aware_optimizer=True, optimizer_cpu_offload=False)
FP32_MODE = types.SimpleNamespace(use_precision_aware_optimizer=False, optimizer_cpu_offload=False)
SHAPES = [(64,), (16, 8), (33,)]

MODES: Dict[str, Dict[str, Any]] = {
    "BF16 params, master remainders": dict(
        param_dtype=torch.bfloat16, master_weights=True, store_param_remainders=True
    ),
    "BF16 params, FP32 master weights": dict(param_dtype=torch.bfloat16, master_weights=True),
    "FP32 params, no TE master weights": dict(param_dtype=torch.float32, master_weights=False),
}


def _adopter() -> TEFusedAdamPrecisionAwareStateAdopter:
    return TEFusedAdamPrecisionAwareStateAdopter(FusedAdamStandIn, param_device_type="cpu")


def _optimizer(param_dtype: torch.dtype, **kwargs: Any) -> FusedAdamStandIn:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).to(param_dtype)) for s in SHAPES]
    return FusedAdamStandIn(
        params, lr=1e-3, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, **kwargs
    )


def _scaffold(param_dtype: torch.dtype, **kwargs: Any) -> Dict[str, Any]:
    """A populated payload in the dtypes MCore's precision-aware scaffold allocates."""
    source = _optimizer(param_dtype, **kwargs)
    generator = torch.Generator().manual_seed(1)
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    for index, param in enumerate(p for g in source.param_groups for p in g["params"]):
        keeps_remainders = source.store_param_remainders and param.dtype == torch.bfloat16
        source.initialize_state(param, keeps_remainders)
        entry = {}
        for key, tensor in source.state[param].items():
            if tensor.dtype == torch.int16:
                entry[key] = torch.randint(-(2**15), 2**15 - 1, tensor.shape, generator=generator, dtype=torch.int16)
            else:
                entry[key] = torch.rand(tensor.shape, generator=generator).to(tensor.dtype)
        state[index] = entry
    groups = source.state_dict()["param_groups"]
    for group in groups:
        group["step"] = 7
    return {"state": state, "param_groups": groups}


def _context_kwargs(config: Any = PRECISION_AWARE) -> Dict[str, Any]:
    return {"config": config, "ddp_config": DistributedDataParallelConfig()}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_adoption_equals_te_loader(mode: str) -> None:
    kwargs = MODES[mode]
    made: List[FusedAdamStandIn] = []

    def make_optimizer() -> FusedAdamStandIn:
        made.append(_optimizer(**kwargs))
        return made[-1]

    outcome = assert_adoption_matches_own_loader(
        _adopter(), make_optimizer, lambda: _scaffold(**kwargs), _context_kwargs()
    )
    adopted, by_te = made
    scales = [
        {k: v.clone() for k, v in optimizer._scales[p].items()}
        for optimizer in (adopted, by_te)
        for p in (q for g in optimizer.param_groups for q in g["params"])
    ]
    half = len(scales) // 2
    assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(scales[:half], scales[half:]))
    bytes_per_element = 2 + 2 + (2 if kwargs.get("store_param_remainders") else 4 if kwargs["master_weights"] else 0)
    elements = sum(s[0] * (s[1] if len(s) > 1 else 1) for s in SHAPES)
    # Measured by MCore's loader: every installed tensor is an incoming one (by reference).
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (bytes_per_element * elements, 0)
    assert adopted.allocations == 0  # not even one parameter's state, transiently


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda o, sd, ctx: ctx.update(config=FP32_MODE), "use_precision_aware_optimizer is not set"),
        (lambda o, sd, ctx: o.name_to_dtype_map.update(exp_avg=torch.float16), "only BF16 moments"),
        (
            lambda o, sd, ctx: sd["state"][0].__setitem__("exp_avg", sd["state"][0]["exp_avg"].float()),
            "parameter 0: exp_avg is torch.float32, not torch.bfloat16",
        ),
        (lambda o, sd, ctx: sd["state"][1].pop("master_param"), "parameter 1: the incoming state has keys"),
        (
            lambda o, sd, ctx: sd["state"][2].__setitem__("master_param", sd["state"][2]["master_param"].float()),
            "parameter 2: master_param is torch.float32, not torch.int16",
        ),
    ],
    ids=["FP32 owner", "FP16 moments", "FP32 incoming moment", "missing master", "master not int16"],
)
def test_declines(change: Any, reason: str) -> None:
    optimizer = _optimizer(**MODES["BF16 params, master remainders"])
    state_dict = _scaffold(**MODES["BF16 params, master remainders"])
    context_kwargs = _context_kwargs()
    change(optimizer, state_dict, context_kwargs)
    context = StateAdoptionContext(optimizer=optimizer, state_dict=state_dict, **context_kwargs)
    answer = assert_check_is_side_effect_free(_adopter(), context)
    assert answer is not None and reason in answer, answer


def _installed_distribution() -> Any:
    try:
        return distribution(DISTRIBUTION)
    except PackageNotFoundError:
        pytest.skip("the plugin is not installed (pip install examples/te-precision-aware-adopter)")


def test_installed_plugin_is_discovered_through_its_entry_point() -> None:
    installed = _installed_distribution()
    registrations = StateAdopterRegistry().registrations()  # no built-in adopters
    assert [r.name for r in registrations] == [ADOPTER_NAME]
    assert isinstance(registrations[0].adopter, TEFusedAdamPrecisionAwareStateAdopter)
    assert registrations[0].origin == (
        f"entry point {ADOPTER_NAME} = {PACKAGE}:TEFusedAdamPrecisionAwareStateAdopter "
        f"({DISTRIBUTION} {installed.version})"
    )
    # In the process-wide registry it comes after the built-in FP32 adopter.
    names = [r.name for r in registered_state_adopters()]
    assert names.index("te_fused_adam_fp32") < names.index(ADOPTER_NAME)


# --- Payload pass: MCore offers FusedAdam's own state_dict() (FP32 copies of BF16 moments) ---


def _loaded(mode: str, seed: int = 1) -> FusedAdamStandIn:
    """An optimizer holding state, as after MCore's scaffold pass and the checkpoint read."""
    optimizer = _optimizer(**MODES[mode])
    scaffold = _scaffold(**MODES[mode])
    generator = torch.Generator().manual_seed(seed)
    for entry in scaffold["state"].values():
        for key, tensor in entry.items():
            if tensor.is_floating_point():
                entry[key] = torch.rand(tensor.shape, generator=generator).to(tensor.dtype)
    optimizer.load_state_dict(scaffold)
    return optimizer


def _payload_context(optimizer: FusedAdamStandIn, state_dict: Dict[str, Any]) -> StateAdoptionContext:
    return StateAdoptionContext(optimizer=optimizer, state_dict=state_dict, **_context_kwargs())


def _with_bf16_bits(optimizer: FusedAdamStandIn, bits: List[int]) -> FusedAdamStandIn:
    """Write raw BF16 bit patterns (e.g. a NaN with a payload) into the first held moment."""
    param = optimizer.param_groups[0]["params"][0]
    held = optimizer.state[param]["exp_avg"].view(torch.int16).view(-1)
    held[: len(bits)] = torch.tensor(bits, dtype=torch.int32).to(torch.int16)
    return optimizer


PAYLOADS = {
    "its own state_dict()": lambda made, mode: made[-1].state_dict(),
    "another run's values": lambda made, mode: _loaded(mode, seed=9).state_dict(),
    "NaN payloads and -0.0 held": lambda made, mode: made[-1].state_dict(),
}


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_payload_pass_loads_into_the_held_state_as_te_loader_would(mode: str, payload: str) -> None:
    made: List[FusedAdamStandIn] = []
    held: List[Dict[Any, Dict[str, torch.Tensor]]] = []
    allocations: List[int] = []

    def make_optimizer() -> FusedAdamStandIn:
        made.append(_loaded(mode))
        if payload.startswith("NaN"):  # TE stores value.bfloat16(): NaNs become canonical
            _with_bf16_bits(made[-1], [0x7F81, 0xFFC1, 0x7F80, -0x8000])
        held.append({p: dict(s) for p, s in made[-1].state.items()})
        allocations.append(made[-1].allocations)
        return made[-1]

    outcome = assert_adoption_matches_own_loader(
        _adopter(), make_optimizer, lambda: PAYLOADS[payload](made, mode), _context_kwargs()
    )
    adopted, by_te = made[0], made[-1]
    assert adopted.allocations == allocations[0]  # nothing allocated
    assert by_te.allocations > allocations[-1]  # TE's loader re-allocated every tensor
    for param, entries in held[0].items():  # BF16 moments stored into the held tensors
        assert all(adopted.state[param][key] is entries[key] for key in ("exp_avg", "exp_avg_sq"))
    # Measured by MCore's loader: every tensor of the resulting state existed before the call.
    held_bytes = sum(t.nbytes for entries in held[0].values() for t in entries.values())
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (held_bytes, 0)
    if payload.startswith("NaN"):
        first = adopted.state[adopted.param_groups[0]["params"][0]]["exp_avg"].view(torch.int16)
        assert first[2:4].tolist() == [0x7F80, -0x8000]  # inf and -0.0 kept; NaNs as TE stores them


def _aliasing_held(sd: Dict[str, Any], o: FusedAdamStandIn) -> None:
    held = o.state[o.param_groups[0]["params"][2]]["master_param"]
    sd["state"][2]["master_param"] = held.view(held.shape)  # same storage, another tensor


@pytest.mark.parametrize(
    "change, reason",
    [
        (
            lambda sd, o: sd["state"][0].__setitem__("exp_avg_sq", sd["state"][0]["exp_avg_sq"].double()),
            "parameter 0: incoming exp_avg_sq is torch.float64, not torch.float32",
        ),
        (
            lambda sd, o: sd["state"][1].__setitem__("exp_avg", sd["state"][1]["exp_avg"][:-1]),
            "parameter 1: incoming exp_avg has shape",
        ),
        (lambda sd, o: sd["state"][1].pop("master_param"), "parameter 1: the incoming state does not have"),
        (_aliasing_held, "parameter 2: incoming master_param shares storage with a held state tensor"),
        (lambda sd, o: o._scales[o.param_groups[0]["params"][0]]["exp_avg"].fill_(2.0), "scale of exp_avg is not one"),
        (lambda sd, o: o.state.pop(o.param_groups[0]["params"][2]), "parameter 2: the held state has keys []"),
        (
            lambda sd, o: o.state[o.param_groups[0]["params"][1]].__setitem__(
                "exp_avg", o.state[o.param_groups[0]["params"][1]]["exp_avg"].float()
            ),
            "parameter 1: held exp_avg is torch.float32, not torch.bfloat16",
        ),
    ],
    ids=["FP64 incoming", "wrong shape", "missing key", "overlaps held", "scale not one", "no held state", "FP32 held"],
)
def test_payload_pass_declines_what_te_would_lay_out_differently(change: Any, reason: str) -> None:
    optimizer = _loaded("BF16 params, master remainders")
    state_dict = optimizer.state_dict()
    change(state_dict, optimizer)
    answer = assert_check_is_side_effect_free(_adopter(), _payload_context(optimizer, state_dict))
    assert answer is not None and reason in answer and "not a scaffold to adopt" in answer, answer


@pytest.mark.parametrize("chunk_elements", [1, 7, 64, 1 << 22])
def test_chunked_store_equals_te_conversion(chunk_elements: int) -> None:
    from mcore_te_precision_aware_adopter.held_state import store_as_te_loads

    incoming = torch.randn(100) * 1e3
    incoming[::9] = float("nan")
    for dtype in (torch.bfloat16, torch.float32):
        expected = torch.empty(100, dtype=dtype).copy_(incoming.bfloat16() if dtype == torch.bfloat16 else incoming)
        held = torch.zeros(100, dtype=dtype)
        store_as_te_loads(incoming, held, chunk_elements)
        assert torch.equal(held.view(torch.uint8), expected.view(torch.uint8))
    remainders = torch.randint(-(2**15), 2**15 - 1, (100,), dtype=torch.int16)
    before = remainders.clone()
    store_as_te_loads(remainders, remainders, chunk_elements)  # the held tensor itself: untouched
    assert torch.equal(remainders, before)
    held_bf16 = torch.tensor([0x7F81, 0xFFC1, 0x7F80, -0x8000, 0x3F80], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    expected = held_bf16.float().bfloat16()
    store_as_te_loads(held_bf16, held_bf16, chunk_elements)  # in place, as TE converts it
    assert torch.equal(held_bf16.view(torch.int16), expected.view(torch.int16))
    held = torch.zeros(100, dtype=torch.int16)
    store_as_te_loads(remainders, held, chunk_elements)
    assert torch.equal(held, remainders)


# --- Export: the state dict MCore reads at the start of a load ---


class Owner:
    """What the loader reads of a DistributedOptimizer (precision-aware configs)."""

    def __init__(self, optimizer: FusedAdamStandIn) -> None:
        self.optimizer = optimizer
        self.config = PRECISION_AWARE
        self.ddp_config = DistributedDataParallelConfig()
        self.is_stub_optimizer = False


def _registry(outcomes: Optional[List[StateAdoptionOutcome]] = None) -> StateAdopterRegistry:
    """An isolated registry holding only this adopter; ``outcomes`` receives its outcomes."""
    registry = StateAdopterRegistry(entry_point_group=None)
    registry.register(_adopter())
    if outcomes is not None:
        registry.register_outcome_hook(outcomes.append)
    return registry


def _bits(optimizer: FusedAdamStandIn) -> List[List[int]]:
    return [
        optimizer.state[p][k].contiguous().view(torch.uint8).tolist()
        for g in optimizer.param_groups
        for p in g["params"]
        for k in sorted(optimizer.state[p])
    ]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_export_supplies_the_held_tensors_and_te_param_groups(mode: str) -> None:
    optimizer = _loaded(mode)
    held = {p: dict(s) for p, s in optimizer.state.items()}
    context = StateExportContext(optimizer=optimizer, **_context_kwargs())
    assert _adopter().export_decline_reason(context) is None
    exported = _adopter().export_state_dict(context)
    assert exported_state_dict_decline_reason(optimizer, exported) is None  # MCore's check
    by_te = optimizer.state_dict()
    assert exported["param_groups"] == by_te["param_groups"]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    assert sorted(exported["state"]) == sorted(by_te["state"]) == list(range(len(params)))
    for index, param in enumerate(params):
        assert exported["state"][index] == held[param] and exported["state"][index] is not optimizer.state[param]
        assert all(exported["state"][index][k] is held[param][k] for k in held[param])
    assert {p: dict(s) for p, s in optimizer.state.items()} == held


@pytest.mark.parametrize("mode", sorted(MODES))
def test_export_matches_te_state_dict_and_is_measured_as_the_held_state(mode: str) -> None:
    """The conformance helper: the export passes MCore's check against the held state, changes
    nothing, and loads (with TE's loader) to the same bits as TE's own state_dict()."""
    outcome = assert_export_matches_own_state_dict(
        _adopter(), lambda: _loaded(mode), _context_kwargs()
    )
    optimizer = _loaded(mode)
    held_bytes = sum(t.nbytes for s in optimizer.state.values() for t in s.values())
    assert outcome.adopter == ADOPTER_NAME and outcome.fallback_reason is None
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (held_bytes, 0)


@pytest.mark.parametrize("nan_payloads", [False, True], ids=["values", "NaN payloads"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_exported_state_loads_to_te_bits_through_either_loader(mode: str, nan_payloads: bool) -> None:
    """MCore's payload pass: read the state dict, hand it back to the inner load."""
    made = [_loaded(mode) for _ in range(3)]
    if nan_payloads:
        for optimizer in made:
            _with_bf16_bits(optimizer, [0x7F81, 0xFFC1, 0x7F80, -0x8000])
    through_plugin, through_te, upstream = made
    upstream.load_state_dict(upstream.state_dict())  # what upstream MCore does

    held = [t for s in through_plugin.state.values() for t in s.values()]
    allocations = through_plugin.allocations
    exported = export_inner_optimizer_state_dict(Owner(through_plugin), registry=_registry())
    outcome = load_inner_optimizer_state_dict(Owner(through_plugin), exported, registry=_registry())
    assert outcome.adopter == "te_fused_adam_precision_aware"
    assert through_plugin.allocations == allocations  # no new state
    assert [t for s in through_plugin.state.values() for t in s.values()] == held
    assert all(a is b for a, b in zip((t for s in through_plugin.state.values() for t in s.values()), held))
    assert _bits(through_plugin) == _bits(upstream)

    # TE's loader (adoption off) on the plugin's export
    through_te.load_state_dict(export_inner_optimizer_state_dict(Owner(through_te), registry=_registry()))
    assert _bits(through_te) == _bits(upstream)
    for optimizer in made[1:]:
        assert [g["step"] for g in optimizer.param_groups] == [g["step"] for g in through_plugin.param_groups]


def _instance_state_dict(o: FusedAdamStandIn, ctx: Dict[str, Any]) -> None:
    o.__dict__["state_dict"] = lambda: torch.optim.Optimizer.state_dict(o)


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda o, ctx: o.state.clear(), "holds no state yet"),
        (lambda o, ctx: o._scales[o.param_groups[0]["params"][0]]["exp_avg"].fill_(2.0), "scale of exp_avg is not one"),
        (lambda o, ctx: o.state.pop(o.param_groups[0]["params"][1]), "parameter 1: the held state has keys []"),
        (_instance_state_dict, "instance has its own state_dict"),
        (lambda o, ctx: ctx.update(config=FP32_MODE), "use_precision_aware_optimizer is not set"),
        (lambda o, ctx: o.name_to_dtype_map.update(exp_avg=torch.float32), "only BF16 moments"),
    ],
    ids=["no state", "scale not one", "a parameter without state", "instance state_dict", "FP32 owner", "FP32 moments"],
)
def test_export_declines(change: Any, reason: str) -> None:
    optimizer = _loaded("BF16 params, master remainders")
    context_kwargs = _context_kwargs()
    change(optimizer, context_kwargs)
    answer = _adopter().export_decline_reason(StateExportContext(optimizer=optimizer, **context_kwargs))
    assert answer is not None and reason in answer, answer


def test_the_loader_falls_back_to_te_state_dict_when_the_export_declines() -> None:
    optimizer = _loaded("BF16 params, master remainders")
    optimizer._scales[optimizer.param_groups[0]["params"][0]]["exp_avg"].fill_(2.0)
    outcomes: List[StateAdoptionOutcome] = []
    exported = export_inner_optimizer_state_dict(Owner(optimizer), registry=_registry(outcomes))
    assert [(o.adopter, o.fallback_reason) for o in outcomes] == [(None, "every state exporter declined")]
    by_te = optimizer.state_dict()
    assert all(
        t.dtype != torch.bfloat16 for entry in exported["state"].values() for t in entry.values()
    )  # TE's FP32 copies
    pairs = [(a, b) for e, f in zip(exported["state"].values(), by_te["state"].values()) for a, b in zip(e.values(), f.values())]
    assert pairs and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs)


# --- The rules MCore's loader enforces for every adopter (the plugin no longer checks them) ---


@pytest.mark.parametrize("kind", ["pre", "post"])
def test_an_optimizer_with_a_load_hook_gets_te_loader_and_each_hook_runs_once(kind: str) -> None:
    optimizer = _optimizer(**MODES["BF16 params, master remainders"])
    calls: List[str] = []
    if kind == "pre":
        optimizer.register_load_state_dict_pre_hook(lambda opt, sd: calls.append("pre"))
    else:
        optimizer.register_load_state_dict_post_hook(lambda opt: calls.append("post"))
    scaffold = _scaffold(**MODES["BF16 params, master remainders"])
    context = StateAdoptionContext(optimizer=optimizer, state_dict=scaffold, **_context_kwargs())
    assert _adopter().decline_reason(context) is None  # the plugin itself would accept
    outcome = load_inner_optimizer_state_dict(Owner(optimizer), scaffold, registry=_registry())
    assert outcome.adopter is None and outcome.declines == ()  # not even asked
    assert outcome.method == "FusedAdamStandIn.load_state_dict"
    assert f"{kind}-hook" in (outcome.fallback_reason or "")
    assert calls == [kind]
    assert outcome.allocated_bytes > 0 and optimizer.allocations > 0  # TE's loader re-allocated


def test_an_optimizer_with_a_state_dict_hook_gets_te_state_dict() -> None:
    optimizer = _loaded("BF16 params, master remainders")
    calls: List[str] = []
    optimizer.register_state_dict_post_hook(lambda opt, sd: calls.append("post") or sd)
    outcomes: List[StateAdoptionOutcome] = []
    exported = export_inner_optimizer_state_dict(Owner(optimizer), registry=_registry(outcomes))
    assert [o.adopter for o in outcomes] == [None] and calls == ["post"]
    assert "post-hook" in (outcomes[0].fallback_reason or "")
    assert all(t.dtype != torch.bfloat16 for e in exported["state"].values() for t in e.values())


# --- Hole 9: against plain upstream megatron-core the plugin must fail loudly ---


def _pyproject() -> Dict[str, Any]:
    path = PLUGIN_ROOT / "pyproject.toml"
    if not path.is_file():  # e.g. a copy of the tests alone (mutation testing)
        pytest.skip(f"{path} is not here")
    return tomllib.loads(path.read_text())


def _pinned_requirement() -> Requirement:
    (requirement,) = [
        Requirement(d)
        for d in _pyproject()["project"]["dependencies"]
        if Requirement(d).name == "megatron-core"
    ]
    return requirement


def test_the_pinned_requirement_is_not_satisfied_by_plain_upstream() -> None:
    """Hole 9: ``megatron-core>=0.16.1`` was satisfied by plain upstream, where the entry point
    never loads; the exact pin is satisfied only by the build the plugin is tested with."""
    specifier = _pinned_requirement().specifier
    assert not specifier.contains("0.19.2")  # plain upstream: pip finds no matching distribution
    assert not specifier.contains("0.19.2", prereleases=True)
    for other in ("0.16.1", "0.18.2+stateadoption", "0.19.3", "0.20.0+stateadoption"):
        assert not specifier.contains(other), other
    assert specifier.contains("0.19.2+stateadoption")
    assert _pyproject()["project"]["version"] == "0.4.0"


def test_the_installed_plugin_is_this_checkout_pinned_to_the_installed_build() -> None:
    """Hole 9: the tests run against the installed plugin; it must be this source, and the
    megatron-core it runs with must be the build it pins."""
    installed = _installed_distribution()
    assert installed.version == _pyproject()["project"]["version"]
    assert [Requirement(r) for r in installed.requires or []] == [_pinned_requirement()]
    megatron_core = importlib.util.find_spec("megatron.core")
    assert megatron_core is not None and megatron_core.origin is not None
    shipping = [  # the megatron-core whose files are imported (not a checkout's bare egg-info)
        dist
        for dist in distributions(name="megatron-core")
        if any(str(f) == "megatron/core/__init__.py" for f in dist.files or [])
    ]
    assert len(shipping) == 1, [dist.version for dist in shipping]
    assert _pinned_requirement().specifier.contains(shipping[0].version)
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.origin is not None
    imported = Path(spec.origin).parent
    for source in sorted((PLUGIN_ROOT / "src" / PACKAGE).glob("*.py")):
        assert (imported / source.name).read_text() == source.read_text(), (
            f"the installed {source.name} is not this checkout's: pip install "
            "examples/te-precision-aware-adopter"
        )


def _import_plugin_in_subprocess(site: Path) -> "subprocess.CompletedProcess[str]":
    """Import the plugin in a fresh interpreter whose path starts with ``site``.

    ``-P`` keeps the current directory (a checkout holds megatron/) off the path; ``-s``
    keeps the user site out. ``site`` comes before site-packages, so a megatron package in
    it shadows the installed megatron-core.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(site)
    return subprocess.run(
        [sys.executable, "-P", "-s", "-c", f"import {PACKAGE} as p; print(p.__file__)"],
        cwd=site,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def plugin_copy(tmp_path: Path) -> Path:
    """A folder holding a copy of the plugin package (the one these tests import)."""
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.origin is not None
    site = tmp_path / "site"
    shutil.copytree(Path(spec.origin).parent, site / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    return site


def test_importing_the_plugin_against_plain_upstream_raises_a_clear_import_error(plugin_copy: Path) -> None:
    """Hole 9: with a megatron-core that has no state-adoption subsystem (plain upstream 0.19.2,
    faked here as a megatron package in front of the installed one) the plugin's import fails,
    naming the missing subsystem, instead of the plugin silently doing nothing."""
    for package in ("megatron", "megatron/core", "megatron/core/optimizer"):
        (plugin_copy / package).mkdir(parents=True, exist_ok=True)
        (plugin_copy / package / "__init__.py").write_text('"""Plain upstream: no state_adoption."""\n')
    dist_info = plugin_copy / "megatron_core-0.19.2.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.19.2\n")
    result = _import_plugin_in_subprocess(plugin_copy)
    assert result.returncode != 0, result.stdout
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ImportError: "), result.stderr
    assert "megatron.core.optimizer.state_adoption" in last_line
    assert "megatron-core 0.19.2 is installed" in last_line


def test_the_same_copy_imports_against_the_state_adoption_build(plugin_copy: Path) -> None:
    """The control for the test above: only the faked upstream package made the import fail."""
    result = _import_plugin_in_subprocess(plugin_copy)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(plugin_copy / PACKAGE / "__init__.py")


# --- read targets: the held BF16 moments are what the checkpoint is read into -----------------


def _read_owner(mode: str, **config_changes: Any) -> Any:
    """A precision-aware DistributedOptimizer (the installed class, tests/mcore_owners.py) whose
    FusedAdam holds the state the scaffold pass leaves."""
    from mcore_owners import precision_aware_owner

    kwargs = dict(MODES[mode])
    return precision_aware_owner(_optimizer(kwargs.pop("param_dtype"), **kwargs), **config_changes)


def _read_resume(owner: Any, registry: StateAdopterRegistry, seed: int = 4) -> List[Dict[str, torch.Tensor]]:
    """MCore's precision-aware dp_reshardable resume of one owner: build the targets (the
    installed _get_main_param_and_optimizer_states inside reading_optimizer_state), read FP32
    checkpoint values into them as torch_dist does (copy_ with its cast), store them (the
    installed _set_main_param_and_optimizer_states)."""
    generator = torch.Generator().manual_seed(seed)
    params = [p for g in owner.optimizer.param_groups for p in g["params"]]
    with reading_optimizer_state(owner, True, registry=registry):
        targets = [owner._get_main_param_and_optimizer_states(p) for p in params]
    for tensors in targets:
        for key, target in tensors.items():
            if target.dtype == torch.int16:
                target.copy_(torch.randint(-(2**15), 2**15 - 1, target.shape, generator=generator, dtype=torch.int16))
            else:
                target.copy_(torch.randn(target.shape, generator=generator) / 7)
    for param, tensors in zip(params, targets):
        owner._set_main_param_and_optimizer_states(param, tensors)
    return targets


# MCore's precision-aware optimizer always keeps TE master weights (FP32 or remainders).
@pytest.mark.parametrize("mode", sorted(m for m in MODES if MODES[m].get("master_weights")))
def test_read_targets_are_the_held_moments_and_the_state_is_te_s(mode: str) -> None:
    outcomes: List[StateAdoptionOutcome] = []
    owner = _read_owner(mode)
    held = {id(t) for entry in owner.optimizer.state.values() for t in entry.values()}
    allocations = owner.optimizer.allocations
    targets = _read_resume(owner, _registry(outcomes))
    assert all(id(t) in held for tensors in targets for t in tensors.values())
    assert owner.optimizer.allocations == allocations
    (outcome,) = [o for o in outcomes if o.hook_point == "read"]
    assert (outcome.adopter, outcome.allocated_bytes) == (ADOPTER_NAME, 0)
    reference = _read_owner(mode)
    _read_resume(reference, StateAdopterRegistry(entry_point_group=None))  # upstream's FP32 copies
    assert _bits(owner.optimizer) == _bits(reference.optimizer)


def _stepped(owner: Any) -> None:
    for group in owner.optimizer.param_groups:
        group["step"] = 3


def _fp32_owner(owner: Any) -> None:
    owner.optimizer.name_to_dtype_map["exp_avg"] = torch.float32


READ_DECLINES = {
    "after a step": (_stepped, "param group 0 has step 3: the held state may be trained state"),
    "not precision-aware": (lambda owner: setattr(owner, "config", FP32_MODE), "precision"),
    "FP32 moments": (_fp32_owner, "only BF16 moments are adopted"),
}


@pytest.mark.parametrize("case", sorted(READ_DECLINES))
def test_read_targets_decline(case: str) -> None:
    change, reason = READ_DECLINES[case]
    owner = _read_owner("BF16 params, master remainders")
    change(owner)
    context = StateExportContext.for_owner(owner)
    declined = _adopter().read_target_decline_reason(context)
    assert declined is not None and reason in declined, declined


def test_the_read_target_check_is_side_effect_free() -> None:
    owner = _read_owner("BF16 params, master remainders")
    before = _bits(owner.optimizer)
    context = StateExportContext.for_owner(owner)
    assert _adopter().read_target_decline_reason(context) is None
    assert _bits(owner.optimizer) == before
