"""``checks.py`` directly: byte-range overlaps, the tensor and state-dict rules adopters chain, and
the result checks the dispatcher applies to every adopter's install, export, initialization and
read targets. Each rule is broken once and named by its reason; real ``torch.optim`` optimizers
(and their own loader and ``state_dict``) give the correct cases.
"""

import copy
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from builders import fresh_standin, make_params, make_standin
from real_optimizers import cloned, fresh_adam, fresh_sgd, params_of, trained_adam, trained_sgd
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron.core.optimizer.state_adoption import AdoptionContext
from megatron.core.optimizer.state_adoption.checks import (
    Extents,
    extent,
    exported_state_problem,
    held_extents,
    incoming_state_problem,
    initialized_state_problem,
    installed_state_problem,
    param_groups_problem,
    read_target_problem,
    same_memory,
    same_value,
    tensor_problem,
)

BF16 = torch.bfloat16


# --- byte ranges ----------------------------------------------------------------------------


def test_extents_find_views_and_aliases_by_the_bytes_they_cover() -> None:
    buffer, other = torch.zeros(16), torch.zeros(16)
    extents = Extents()
    assert extents.add(buffer[:4], "a") is None and extents.add(buffer[8:12], "b") is None
    assert extents.overlap(buffer[4:8]) is None  # adjacent on both sides
    assert extents.overlap(buffer[3:5]) == "a" and extents.overlap(buffer[11:]) == "b"
    assert extents.overlap(buffer.view(4, 4)[0]) == "a"  # an alias through another view
    assert extents.overlap(buffer[4:13:8]) == "b"  # a strided view: first to last byte, gaps too
    assert extents.overlap(buffer[:4].view(torch.uint8)[15:]) == "a"  # one byte is enough
    assert extents.overlap(other[:4]) is None  # another storage
    assert extents.overlap(buffer[:0]) is None and extents.add(buffer[2:2], "empty") is None
    meta = torch.zeros(4, device="meta")  # no memory: meta tensors overlap nothing, not each other
    assert extents.add(meta, "meta") is None and extents.overlap(torch.zeros(4, device="meta")) is None


def test_an_equal_range_is_allowed_only_under_its_own_label() -> None:
    held = torch.zeros(8)
    extents = Extents()
    extents.add(held, "held x")
    assert extents.overlap(held.view(2, 4), allowed="held x") is None
    assert extents.overlap(held[:4], allowed="held x") == "held x"  # not the equal range
    assert extents.overlap(held, allowed="held y") == "held x"
    assert extents.add(held, "target x", allowed="held x") is None
    assert extents.overlap(held, allowed="held x") == "target x"  # taken once allowed


def test_a_range_hidden_behind_a_later_nested_one_is_still_found() -> None:
    """Ranges that overlap each other may be added (the installed check adds every held and
    incoming tensor); a query must still find the large one behind a small one nested in it."""
    buffer = torch.zeros(8)
    extents = Extents()
    extents.add(buffer, "large")
    extents.add(buffer[1:3], "nested")
    assert extents.overlap(buffer[5:7]) == "large"


# --- one tensor -----------------------------------------------------------------------------


class _Tagged(torch.Tensor):
    """A tensor subclass, as TE's QuantizedTensor is."""


LIKE = torch.zeros(4)
TENSOR_RULES = {
    "a plain tensor": (lambda: torch.ones(4), None),
    "a Parameter": (lambda: torch.nn.Parameter(torch.ones(4), requires_grad=False),
                    "is a Parameter, not a plain torch.Tensor"),
    "a subclass": (lambda: torch.ones(4).as_subclass(_Tagged), "is a _Tagged, not a plain torch.Tensor"),
    "not a tensor": (lambda: [0.0] * 4, "is a list, not a plain torch.Tensor"),
    "quantized": (lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8),
                  "is quantized or has layout torch.strided"),
    "sparse": (lambda: torch.ones(4).to_sparse(), "is quantized or has layout torch.sparse_coo"),
    "a negated view": (lambda: torch._neg_view(torch.ones(4)), "is a negated or conjugated view"),
    "a conjugated view": (lambda: torch.ones(4, dtype=torch.complex64).conj(), "is a negated or conjugated view"),
    "another dtype": (lambda: torch.ones(4, dtype=torch.float64), "is torch.float64, not torch.float32"),
    "another device": (lambda: torch.ones(4, device="meta"), "is on meta, the parameter on cpu"),
    "another shape": (lambda: torch.ones(2, 2), "has shape (2, 2), the parameter (4,)"),
    "not contiguous": (lambda: torch.ones(4, 2)[:, 0], "is not contiguous"),
    "stride 0": (lambda: torch.ones(1).expand(4), "is not contiguous"),
    "requires grad": (lambda: torch.ones(4, requires_grad=True), "requires grad"),
}  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", TENSOR_RULES)
def test_tensor_problem_accepts_only_a_dense_plain_tensor_like_the_parameter(case: str) -> None:
    make, reason = TENSOR_RULES[case]
    assert tensor_problem(make(), torch.float32, LIKE) == reason


def _dtensor(local: torch.Tensor, mesh: Any, placement: Any = None, **layout: Any) -> DTensor:
    return DTensor.from_local(local, mesh, [placement or Shard(0)], run_check=False, **layout)


def test_tensor_problem_requires_a_dtensor_of_the_parameters_layout(cpu_mesh: Any) -> None:
    like = _dtensor(torch.zeros(4), cpu_mesh)
    assert tensor_problem(_dtensor(torch.ones(4), cpu_mesh), torch.float32, like) is None
    cases = {
        "is a Tensor, the parameter a DTensor": torch.ones(4),
        "has another placements than the parameter": _dtensor(torch.ones(4), cpu_mesh, Replicate()),
        "has another shape than the parameter": _dtensor(
            torch.ones(4), cpu_mesh, shape=(8,), stride=(1,)
        ),
        "has another stride than the parameter": _dtensor(
            torch.ones(4), cpu_mesh, shape=(4,), stride=(2,)
        ),
        "is torch.float64, not torch.float32": _dtensor(torch.ones(4).double(), cpu_mesh),
    }
    for reason, value in cases.items():
        assert tensor_problem(value, torch.float32, like) == reason
    assert (
        tensor_problem(like, torch.float32, torch.zeros(4))
        == "is a DTensor, not a plain torch.Tensor"
    )


def test_same_memory_means_the_same_elements_of_the_same_memory(cpu_mesh: Any) -> None:
    held = torch.arange(6.0)
    assert (
        same_memory(held, held) and same_memory(held, held.detach()) and same_memory(held, held[:])
    )
    assert not same_memory(held, held.view(2, 3)) and not same_memory(held, held[1:])
    assert not same_memory(held, held.view(torch.int32)) and not same_memory(held, held.clone())
    assert not same_memory(held, None) and not same_memory([1], [1])
    for local in (torch.arange(4.0), torch.zeros(0)):  # an empty local shard too
        dtensor = _dtensor(local, cpu_mesh)
        assert same_memory(dtensor, dtensor), f"a DTensor of {local.numel()} elements is not itself"
        # two DTensors of one local shard are the same memory; two empty ones share nothing to
        # tell apart, so any empty tensor of the held layout is the held one
        assert same_memory(dtensor, _dtensor(local, cpu_mesh))
    assert same_memory(torch.zeros(0), torch.zeros(0)) and not same_memory(
        torch.zeros(0), torch.zeros(0, 1)
    )


class _Opaque:
    """A hyper-parameter without an ``==`` of its own (PyTorch's loader deep-copies groups)."""


@pytest.mark.parametrize(
    "installed, given, same",
    [
        (0.5, 0.5, True), ((0.9, 0.999), [0.9, 0.999], False), (1, 1.0, False),
        (float("nan"), float("nan"), False), (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), True),
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), False), (torch.tensor(1.0), torch.tensor(1), False),
        (torch.tensor(1.0), 1.0, False), (_Opaque(), _Opaque(), True), (_Opaque(), object(), False),
        ([torch.tensor([1.0, 2.0])], [torch.tensor([1.0, 2.0])], False),  # == has no truth value
    ],
)  # fmt: skip
def test_same_value_compares_hyper_parameters_by_value(
    installed: Any, given: Any, same: bool
) -> None:
    assert same_value(installed, given) is same
    assert same_value(given, given)


# --- a load's state dict --------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda sd: None, None),
        (lambda sd: sd.pop("state"), "the state dict lacks a 'state' mapping or a 'param_groups' list"),
        (lambda sd: sd.__setitem__("param_groups", tuple(sd["param_groups"])),
         "the state dict lacks a 'state' mapping or a 'param_groups' list"),
        (lambda sd: sd["param_groups"].pop(), "the state dict has 1 param groups, the optimizer 2"),
        (lambda sd: sd["param_groups"][1].pop("params"), "param group 1 of the state dict has no 'params' list"),
        (lambda sd: sd["param_groups"][0]["params"].append(9),
         "param group 0 has 3 params in the state dict, 2 in the optimizer"),
    ],
)  # fmt: skip
def test_param_groups_problem_is_pytorchs_group_validation_without_raising(
    change: Any, reason: Any
) -> None:
    optimizer = fresh_sgd()
    state_dict = cloned(trained_sgd().state_dict())
    change(state_dict)
    assert param_groups_problem(optimizer, state_dict) == reason
    assert param_groups_problem(optimizer, None) == param_groups_problem(optimizer, []) is not None


def _mv(param: torch.Tensor) -> Dict[str, torch.dtype]:
    return {"m": torch.float32, "v": torch.float32}


def _incoming(change: Callable[[Dict[str, Any], torch.optim.Optimizer], Any] = lambda sd, o: None,
              owns: bool = True, param_problem: Any = lambda param: None) -> Optional[str]:  # fmt: skip
    """Check a payload of ``m``/``v`` for an SGD over parameters 0 to 3, changed by ``change``."""
    optimizer = fresh_sgd()
    state = {
        i: {"m": torch.zeros(p.shape), "v": torch.ones(p.shape)}
        for i, p in enumerate(params_of(optimizer))
    }
    state_dict = {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}
    change(state_dict, optimizer)
    context = AdoptionContext(optimizer=optimizer, state_dict=state_dict, owns_state_dict=owns)
    return incoming_state_problem(context, param_problem, _mv)


def _held_as_incoming(state_dict: Dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """The optimizer holds the payload's tensors (an alias of one), as in MCore's second pass."""
    for state_id, param in enumerate(params_of(optimizer)):
        optimizer.state[param] = dict(state_dict["state"][state_id])
    state_dict["state"][0]["m"] = state_dict["state"][0]["m"].detach()


@pytest.mark.parametrize(
    "change, owns, reason",
    [
        (lambda sd, o: None, True, None),
        (lambda sd, o: sd["param_groups"].pop(), True, "the state dict has 1 param groups, the optimizer 2"),
        (lambda sd, o: sd["state"].pop(1), True, "parameter 1: has no incoming state"),
        (lambda sd, o: sd["state"].__setitem__(7, {}), True,
         "the incoming state does not hold exactly one entry per parameter"),
        (lambda sd, o: sd["state"][2].pop("v"), True, "parameter 2: the incoming state has keys ['m'], not ['m', 'v']"),
        (lambda sd, o: sd["state"][1].__setitem__("v", torch.ones(2, 3).double()), True,
         "parameter 1: incoming v is torch.float64, not torch.float32"),
        (lambda sd, o: sd["state"][0].__setitem__("v", sd["state"][0]["m"]), True,
         "parameter 0: incoming v overlaps incoming m"),
        (lambda sd, o: sd["state"][3].__setitem__("m", params_of(o)[3].detach()), True,
         "parameter 3: incoming m overlaps parameter 3"),
        (lambda sd, o: sd["state"][2].__setitem__("m", sd["state"][0]["m"].view(6)), True,
         "parameter 2: incoming m overlaps incoming m"),
        (lambda sd, o: None, False,
         "parameter 0: incoming m is the caller's tensor, not the held one: the caller may keep it"),
        (_held_as_incoming, False, None),
    ],
    ids=["as given", "groups", "no entry", "entry for no parameter", "keys", "tensor", "two keys one tensor",
         "a parameter's memory", "another parameter's entry", "the caller's tensors", "the held tensors"],
)  # fmt: skip
def test_incoming_state_problem_names_the_first_broken_rule(
    change: Any, owns: bool, reason: Any
) -> None:
    assert _incoming(change, owns) == reason


def test_incoming_state_problem_asks_the_parameter_rule_in_order_and_skips_empty_shards() -> None:
    asked: List[int] = []

    def only_small(param: torch.Tensor) -> Optional[str]:
        asked.append(param.numel())
        return None if param.numel() < 6 else f"has {param.numel()} elements"

    assert _incoming(param_problem=only_small) == "parameter 0: has 6 elements" and asked == [6]
    empty = lambda sd, o: (o.param_groups[1]["params"].__setitem__(1, torch.nn.Parameter(torch.zeros(0))),
                           sd["state"].pop(3))  # fmt: skip
    assert _incoming(empty) is None  # an empty local shard has no state


# --- the result checks ----------------------------------------------------------------------


def _install(install: Callable[[torch.optim.Optimizer, Dict[str, Any]], Any], prepare: Any = None,
             holds: bool = False, handed_back: bool = False) -> Optional[str]:  # fmt: skip
    """``install`` a trained SGD's cloned state dict (changed by ``prepare``; the held tensors if
    ``handed_back``) into an SGD (holding state if ``holds``), checked as the dispatcher does."""
    optimizer = trained_sgd() if holds else fresh_sgd()
    given = cloned(trained_sgd().state_dict())
    if handed_back:
        given = torch.optim.Optimizer.state_dict(optimizer)
    if prepare is not None:
        prepare(given)
    params = [list(group["params"]) for group in optimizer.param_groups]
    snapshot = dict(given, state={k: dict(v) for k, v in given["state"].items()})
    install(optimizer, given)
    return installed_state_problem(optimizer, snapshot, params)


def _pytorch(optimizer: torch.optim.Optimizer, given: Dict[str, Any]) -> None:
    torch.optim.Optimizer.load_state_dict(optimizer, given)


def _then(change: Callable[[torch.optim.Optimizer, Dict[str, Any]], Any]) -> Any:
    return lambda optimizer, given: (_pytorch(optimizer, given), change(optimizer, given))


def _buffer(index: int, value: Callable[[torch.optim.Optimizer, Dict[str, Any]], Any]) -> Any:
    return _then(
        lambda o, g: o.state[params_of(o)[index]].__setitem__("momentum_buffer", value(o, g))
    )


def _copies(optimizer: torch.optim.Optimizer, given: Dict[str, Any]) -> None:
    """What TE's loader does: new memory for every tensor."""
    _pytorch(optimizer, given)
    for entry in optimizer.state.values():
        entry["momentum_buffer"] = entry["momentum_buffer"].clone()


def _swapped_with_held(optimizer: torch.optim.Optimizer, given: Dict[str, Any]) -> None:
    kept = optimizer.state[params_of(optimizer)[0]]["momentum_buffer"]
    _pytorch(optimizer, given)
    optimizer.state[params_of(optimizer)[2]]["momentum_buffer"] = kept


def _kept_held(optimizer: torch.optim.Optimizer, given: Dict[str, Any]) -> None:
    """Installs everything but keeps parameter 1's old tensor: its incoming values never load."""
    kept = optimizer.state[params_of(optimizer)[1]]["momentum_buffer"]
    _pytorch(optimizer, given)
    optimizer.state[params_of(optimizer)[1]]["momentum_buffer"] = kept


def _nested(given: Dict[str, Any]) -> None:
    """Parameter 0's incoming tensor covers elements 0 to 5 of a buffer, parameter 1's 1 and 2."""
    buffer = torch.zeros(9)
    given["state"][0]["momentum_buffer"], given["state"][1]["momentum_buffer"] = (
        buffer[:6],
        buffer[1:3],
    )


MB = "momentum_buffer of parameter"
ITSELF = "is not the incoming tensor itself"


def _C(install: Any, reason: Optional[str], name: str, **options: Any) -> Any:
    return pytest.param(install, reason, options, id=name)


INSTALLS = [
    # the caller's tensors kept: whether they may be is the adopter's rule (PyTorch's own loader
    # keeps them, TE's copies), incoming_state_problem's, tested above
    _C(_pytorch, None, "PyTorch's loader"),
    _C(_pytorch, None, "the held tensors handed back", holds=True, handed_back=True),
    # an install keeps the incoming tensors themselves: copies (TE's loader) are not adoption
    _C(_copies, f"{MB} 0 {ITSELF}", "new memory like the incoming"),
    _C(_buffer(1, lambda o, g: torch.zeros(6)), f"{MB} 1 {ITSELF}", "new memory of another shape"),
    _C(_buffer(1, lambda o, g: torch.zeros(2, 3, device="meta")), f"{MB} 1 {ITSELF}",
       "new memory elsewhere"),
    _C(_buffer(1, lambda o, g: g["state"][1]["momentum_buffer"].bfloat16()), f"{MB} 1 {ITSELF}",
       "a BF16 copy"),
    _C(_buffer(1, lambda o, g: torch.zeros_like(g["state"][1]["momentum_buffer"])), f"{MB} 1 {ITSELF}",
       "zeros instead of the checkpoint's values"),
    _C(_then(lambda o, g: o.param_groups[0]["params"].append(torch.zeros(1))),
       "the param groups do not hold the optimizer's parameters", "a parameter added"),
    _C(_then(lambda o, g: o.param_groups[1]["params"].__setitem__(0, torch.zeros(6))),
       "the param groups do not hold the optimizer's parameters", "a parameter replaced"),
    _C(_then(lambda o, g: o.param_groups[1].__setitem__("lr", 0.25)), "param group 1 does not have the state dict's lr",
       "a hyper-parameter changed"),
    _C(_then(lambda o, g: o.param_groups[0].pop("momentum")), "param group 0 does not have the state dict's momentum",
       "a hyper-parameter missing"),
    _C(_then(lambda o, g: o.state.__setitem__(torch.zeros(1), {})),
       "there is state for something that is no parameter of the optimizer", "state for no parameter"),
    _C(_then(lambda o, g: o.state.__setitem__(params_of(o)[2], {"momentum_buffer": torch.zeros(6)})),
       "parameter 2 has state, the state dict none",
       "state the state dict has not", prepare=lambda g: g["state"].pop(2)),
    _C(_then(lambda o, g: o.state[params_of(o)[1]].clear()), "the state of parameter 1 does not have the state dict's keys",
       "a key missing"),
    _C(_then(lambda o, g: o.state[params_of(o)[1]].__setitem__("x", 1)),
       "the state of parameter 1 does not have the state dict's keys", "a key added"),
    _C(_then(lambda o, g: o.state[params_of(o)[0]].pop("x")), None, "a None value left out",
       prepare=lambda g: g["state"][0].__setitem__("x", None)),
    _C(_pytorch, None, "a None value kept", prepare=lambda g: g["state"][0].__setitem__("x", None)),
    _C(_then(lambda o, g: o.state[params_of(o)[1]].clear()), "the state of parameter 1 does not have the state dict's keys",
       "a key missing after a parameter without state", prepare=lambda g: g["state"].pop(0)),
    _C(_buffer(0, lambda o, g: g["state"][2]["momentum_buffer"]), f"{MB} 0 {ITSELF}",
       "another parameter's incoming tensor"),
    _C(_buffer(0, lambda o, g: g["state"][2]["momentum_buffer"].view(2, 3)[1]), f"{MB} 0 {ITSELF}",
       "... through a view"),
    _C(_kept_held, f"{MB} 1 {ITSELF}", "its own held tensor kept instead of the incoming", holds=True),
    _C(_swapped_with_held, f"{MB} 2 {ITSELF}", "another parameter's held tensor", holds=True),
    _C(_buffer(2, lambda o, g: g["state"][0]["momentum_buffer"]._base[3:9]), f"{MB} 2 {ITSELF}",
       "... behind a nested one", prepare=_nested),
]  # fmt: skip


@pytest.mark.parametrize("install, reason, options", INSTALLS)
def test_installed_state_problem_accepts_what_every_loader_gets_right(
    install: Any, reason: Any, options: Dict[str, Any]
) -> None:
    assert _install(install, **options) == reason


def test_a_tensor_installed_for_a_non_tensor_is_not_compared_with_it() -> None:
    """Adam's own loader turns an old checkpoint's float ``step`` into a tensor (its
    ``__setstate__``): no tensor was given to compare it with, and the install is right."""
    optimizer, given = fresh_adam(), cloned(trained_adam().state_dict())
    for entry in given["state"].values():
        entry["step"] = float(entry["step"])
    params = [list(group["params"]) for group in optimizer.param_groups]
    snapshot = dict(given, state={k: dict(v) for k, v in given["state"].items()})
    optimizer.load_state_dict(given)
    assert isinstance(optimizer.state[params[0][0]]["step"], torch.Tensor)
    assert installed_state_problem(optimizer, snapshot, params) is None


def _exported(change: Callable[[Dict[str, Any], torch.optim.Optimizer], Any]) -> Optional[str]:
    """Check a trained Adam's own ``state_dict()`` (its held tensors), changed by ``change``."""
    optimizer = trained_adam()
    exported = optimizer.state_dict()
    exported["state"] = {key: dict(entry) for key, entry in exported["state"].items()}
    change(exported, optimizer)
    return exported_state_problem(optimizer, exported)


def _swap(sd: Dict[str, Any], optimizer: Any) -> None:
    sd["state"][0], sd["state"][2] = sd["state"][2], sd["state"][0]  # parameters of one shape


def _held_scale(value: Any) -> Callable[[Dict[str, Any], Any], None]:
    def change(sd: Dict[str, Any], optimizer: Any) -> None:
        optimizer.state[params_of(optimizer)[0]]["scale"] = 0.5
        sd["state"][0]["scale"] = value

    return change


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda sd, o: None, None),
        (lambda sd, o: sd["state"][1].update(exp_avg=sd["state"][1]["exp_avg"].detach()), None),
        (lambda sd, o: sd["param_groups"][0].update(betas=tuple(list(sd["param_groups"][0]["betas"]))), None),
        (lambda sd, o: o.state.__setitem__(torch.zeros(3), {"exp_avg": torch.zeros(3)}), None),
        (_held_scale(0.5), None),
        (lambda sd, o: sd.__setitem__("extra", 1), "the export is not a dict of 2 items as held"),
        (lambda sd, o: sd["param_groups"].pop(), "the export['param_groups'] is not a list of 2 items as held"),
        (lambda sd, o: sd["param_groups"][1].update(params=[3, 2]), "the export['param_groups'][1]['params'][0] is 3, not the held 2"),
        (lambda sd, o: sd["param_groups"][1].update(lr=0.25), "the export['param_groups'][1]['lr'] is 0.25, not the held 0.5"),
        (lambda sd, o: sd["param_groups"][0].pop("betas"), "the export['param_groups'][0] is not a dict of 12 items as held"),
        (lambda sd, o: sd["state"].clear(), "the export['state'] is not a dict of 4 items as held"),
        (lambda sd, o: sd["state"].pop(3), "the export['state'] is not a dict of 4 items as held"),
        (_swap, "the export['state'][0]['step'] is not the held tensor"),
        (lambda sd, o: sd["state"].__setitem__(4, sd["state"].pop(3)),
         "the export['state'] has the keys ['0', '1', '2', '4'], not the held ones"),
        (lambda sd, o: sd["state"][2].update(copy.deepcopy(sd["state"][2])), "the export['state'][2]['step'] is not the held tensor"),
        (lambda sd, o: sd["state"][1].update(exp_avg=sd["state"][1]["exp_avg"].view(6)),
         "the export['state'][1]['exp_avg'] is not the held tensor"),
        (lambda sd, o: sd["state"][0].pop("exp_avg_sq"), "the export['state'][0] is not a dict of 3 items as held"),
        (_held_scale(0.25), "the export['state'][0]['scale'] is 0.25, not the held 0.5"),
        (_held_scale(torch.tensor(0.5)), "the export['state'][0]['scale'] is tensor(0.5000), not the held 0.5"),
    ],
    ids=["its own state_dict", "an alias", "an equal copy of a hyper-parameter", "stale state of no parameter",
         "an equal non-tensor", "an extra key", "group count", "ids", "a hyper-parameter", "a group key",
         "empty", "partial", "permuted", "renumbered", "copies", "another shape", "a key", "a non-tensor value",
         "a tensor for a non-tensor"],
)  # fmt: skip
def test_exported_state_problem_accepts_only_the_held_state(change: Any, reason: Any) -> None:
    assert _exported(change) == reason
    assert exported_state_problem(fresh_sgd(), fresh_sgd().state_dict()) is None  # no state yet


def test_initialized_state_problem_requires_state_for_every_non_empty_parameter() -> None:
    optimizer = fresh_standin()
    optimizer.param_groups[1]["params"].append(torch.nn.Parameter(torch.zeros(0)))  # an empty shard
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.step()  # TE's step without gradients creates every parameter's state
    del optimizer.state[params[-1]]
    assert initialized_state_problem(optimizer, params) is None
    optimizer.state[params[1]] = {"step": 1}  # no tensor
    assert initialized_state_problem(optimizer, params) == "parameter 1 has no state"
    del optimizer.state[params[1]]
    assert initialized_state_problem(optimizer, params) == "parameter 1 has no state"
    optimizer.initialize_state(params[1])
    one = torch.nn.Parameter(torch.zeros(1))  # a one-element shard needs state too
    assert initialized_state_problem(optimizer, params + [one]) == "parameter 5 has no state"
    optimizer.state[torch.zeros(1)] = {"exp_avg": torch.zeros(1)}
    assert (
        initialized_state_problem(optimizer, params)
        == "there is state for something that is no parameter of the optimizer"
    )


def _read_owner(remainders: bool) -> Any:
    """TE's state before a precision-aware read: BF16 moments, int16 remainders (BF16 params) or
    FP32 master weights (FP32 params)."""
    optimizer = make_standin(make_params(0, BF16 if remainders else torch.float32), master_weights=True,
                             store_param_remainders=remainders, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)  # fmt: skip
    for param in params_of(optimizer):
        optimizer.initialize_state(param, remainders)
    return optimizer


def _target(
    remainders: bool, name: str, make: Callable[[Any, List[Any]], Any], index: int = 0
) -> Optional[str]:
    """Check ``make(optimizer, params)`` as parameter ``index``'s ``name`` target, after parameter
    0's ``exp_avg`` target (its held tensor) and a new FP32 target for its ``exp_avg_sq``."""
    optimizer = _read_owner(remainders)
    params, extents = params_of(optimizer), held_extents(optimizer)
    scratch = torch.zeros(64)
    for key, target in (
        ("exp_avg", optimizer.state[params[0]]["exp_avg"]),
        ("exp_avg_sq", scratch),
    ):
        assert (
            read_target_problem(optimizer, params[0], key, target, extents, f"{key} of parameter 0")
            is None
        )
    optimizer.scratch = scratch
    target = make(optimizer, params)
    return read_target_problem(
        optimizer, params[index], name, target, extents, f"{name} of parameter {index}"
    )


def _held_target(name: str, index: int = 1) -> Callable[[Any, List[Any]], Any]:
    return lambda o, params: o.state[params[index]][name]


@pytest.mark.parametrize(
    "remainders, name, make, index, reason",
    [
        (True, "exp_avg", _held_target("exp_avg"), 1, None),
        (True, "master_param", _held_target("master_param"), 1, None),
        (False, "master_param", _held_target("master_param"), 1, None),
        (False, "exp_avg", lambda o, p: torch.zeros(16, 8), 1, None),
        (True, "master_param", lambda o, p: torch.zeros(16, 8, dtype=torch.int16), 1, None),
        (True, "nothing", lambda o, p: torch.zeros(16, 8), 1, "the optimizer holds no 'nothing' for this parameter"),
        (True, "exp_avg", lambda o, p: torch.zeros(16, 8, dtype=BF16), 1, "the target is torch.bfloat16, not torch.float32"),
        (True, "master_param", lambda o, p: torch.zeros(16, 8), 1, "the target is torch.float32, not torch.int16"),
        (True, "exp_avg", lambda o, p: torch.zeros(1).expand(16, 8), 1, "the target is not contiguous"),
        (True, "exp_avg", lambda o, p: torch.zeros(128), 1, "the target has shape (128,), the parameter (16, 8)"),
        (True, "exp_avg", _held_target("exp_avg", 0), 0, "the target overlaps target exp_avg of parameter 0"),
        (True, "exp_avg", lambda o, p: o.scratch[:7], 2, "the target overlaps target exp_avg_sq of parameter 0"),
        (False, "exp_avg", lambda o, p: o.state[p[2]]["master_param"], 2,
         "the target overlaps held master_param of parameter 2"),
        (False, "exp_avg", lambda o, p: p[1].detach(), 1, "the target overlaps parameter 1"),
    ],
    ids=["a held BF16 moment", "held int16 remainders", "held FP32 master weights", "a new FP32 target",
         "new int16 remainders", "no such state", "a new BF16 target", "FP32 for remainders", "stride 0",
         "another shape", "the same held target twice", "another target", "another key's held tensor",
         "a parameter"],
)  # fmt: skip
def test_read_target_problem_accepts_the_held_tensor_or_new_memory_overlapping_nothing(
    remainders: bool, name: str, make: Any, index: int, reason: Any
) -> None:
    assert _target(remainders, name, make, index) == reason


def test_a_held_state_te_scales_needs_an_fp32_target() -> None:
    optimizer = _read_owner(True)
    param = params_of(optimizer)[0]
    optimizer.state[param]["exp_avg"] = optimizer.state[param]["exp_avg"].half()
    held, extents = optimizer.state[param]["exp_avg"], held_extents(optimizer)
    assert read_target_problem(
        optimizer, param, "exp_avg", held, extents, "exp_avg of parameter 0"
    ) == ("the held 'exp_avg' is torch.float16, which TE scales: it needs an FP32 target")


def test_a_parameter_without_state_has_no_held_ranges_and_no_read_target() -> None:
    optimizer = _read_owner(False)
    params = params_of(optimizer)
    del optimizer.state[params[1]]
    extents = held_extents(optimizer)
    assert extents.overlap(params[1].detach()) == "parameter 1"
    assert extents.overlap(optimizer.state[params[2]]["exp_avg"]) == "held exp_avg of parameter 2"
    target = torch.zeros(16, 8)
    assert read_target_problem(
        optimizer, params[1], "exp_avg", target, extents, "exp_avg of parameter 1"
    ) == ("the optimizer holds no 'exp_avg' for this parameter")


def test_a_tensor_without_strided_storage_covers_no_memory() -> None:
    """A sparse tensor has no storage to walk: ``extent`` says so instead of raising."""
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,))
    assert extent(sparse) is None and extent(torch.zeros(0)) is None
    assert extent(torch.zeros(4)) is not None
