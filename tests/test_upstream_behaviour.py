"""Whatever upstream would run still runs, exactly as often, and fails exactly as upstream fails.

Upstream MCore ends ``DistributedOptimizer.load_state_dict`` with
``self.optimizer.load_state_dict(...)`` and starts it with ``self.optimizer.state_dict()``.
Both resolve a method set on the optimizer *instance* before the class's one: Megatron-Bridge
0.6.2's memory-efficient FP32 loading sets one (``types.MethodType`` on each inner FusedAdam),
and so can a user's wrapper. ``_install_instance_loader`` below emulates that pattern: it
installs the state with PyTorch's loader only, by reference, as such a loader does. Both also
run the optimizer's ``load_state_dict``/``state_dict`` pre- and post-hooks once. And when the
own method raises, the caller sees that very exception, with an outcome recording it.

TE's FusedAdam is reproduced by ``FusedAdamStandIn``, including the differences between TE
releases (``te_release``; see docs/te-releases.md).
"""

import types
import weakref
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from adopters_for_tests import DecliningAdopter, Exporter, PyTorchLoaderAdopter, RaisingAfterLoaderAdopter, pytorch_state_dict
from builders import (
    registry_of,
    load_through,
    export_through,
    assert_bitwise_equal,
    cloned_state_dict,
    fresh_standin,
    standin_adopter,
    standin_registry,
    state_tensors,
    trained_standin,
)
from fused_adam_standin import FusedAdamStandIn
from outcome_recording import recorded_outcomes
from real_optimizers import assert_same_state, cloned, fresh_adam, trained_adam

from megatron.core.optimizer.state_adoption.te_fused_adam import TEFusedAdamFP32StateAdopter

DISABLE_ENV_VAR = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"


# --- methods set on the instance (Megatron-Bridge's loader) -------------------------------


def _install_instance_loader(optimizer: torch.optim.Optimizer, calls: List[Dict[str, Any]]) -> None:
    """Set an instance-level ``load_state_dict`` that records its calls and loads by reference."""

    def load_state_dict(self: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        calls.append(state_dict)
        torch.optim.Optimizer.load_state_dict(self, state_dict)

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]


def test_an_instance_loader_runs_once_with_the_callers_dict_and_no_adopter_is_asked() -> None:
    permissive = PyTorchLoaderAdopter("permissive")  # accepts any optimizer, never checks the instance
    registry = standin_registry(permissive, standin_adopter())
    optimizer = fresh_standin()
    calls: List[Dict[str, Any]] = []
    _install_instance_loader(optimizer, calls)
    payload = cloned_state_dict(trained_standin())
    incoming = [payload["state"][i][k] for i in sorted(payload["state"]) for k in ("exp_avg", "exp_avg_sq")]
    outcome = load_through(optimizer, payload, registry)
    assert len(calls) == 1 and calls[0] is payload  # the dict the caller assembled, as upstream
    assert permissive.checked == [] and outcome.declines == ()
    assert outcome.adopter is None and outcome.method == "load_state_dict set on the FusedAdamStandIn instance"
    assert "the FusedAdamStandIn instance has its own load_state_dict" in (outcome.fallback_reason or "")
    assert optimizer.allocations == 0  # the instance loader's by-reference load, not TE's copy
    assert all(a is b for a, b in zip(state_tensors(optimizer), incoming))


def test_removing_the_instance_loader_makes_adoption_happen_again() -> None:
    registry = standin_registry()
    optimizer = fresh_standin()
    calls: List[Dict[str, Any]] = []
    _install_instance_loader(optimizer, calls)
    load_through(optimizer, cloned_state_dict(trained_standin()), registry)
    del optimizer.load_state_dict
    outcome = load_through(optimizer, cloned_state_dict(trained_standin()), registry)
    assert len(calls) == 1 and outcome.adopter == "te_fused_adam_fp32"


def test_the_kill_switch_calls_the_instance_loader_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV_VAR, "1")
    optimizer = fresh_standin()
    calls: List[Dict[str, Any]] = []
    _install_instance_loader(optimizer, calls)
    payload = cloned_state_dict(trained_standin())
    outcome = load_through(optimizer, payload, standin_registry())
    assert len(calls) == 1 and calls[0] is payload
    assert outcome.method == "load_state_dict set on the FusedAdamStandIn instance"


def test_an_instance_state_dict_is_never_bypassed_by_an_exporter() -> None:
    exporter = Exporter("permissive_exporter", pytorch_state_dict)
    registry = registry_of(exporter)
    optimizer = trained_standin()
    sentinel: Dict[str, Any] = {"state": {}, "param_groups": []}
    calls: List[int] = []

    def state_dict(self: torch.optim.Optimizer) -> Dict[str, Any]:
        calls.append(1)
        return sentinel

    optimizer.state_dict = types.MethodType(state_dict, optimizer)  # type: ignore[method-assign]
    with recorded_outcomes(registry) as outcomes:
        assert export_through(optimizer, registry) is sentinel
    assert calls == [1] and exporter.checks == 0
    assert outcomes[0].method == "state_dict set on the FusedAdamStandIn instance"
    del optimizer.state_dict
    exported = export_through(optimizer, registry)
    assert len(exporter.exports) == 1 and exporter.exports[0] is exported


# --- load_state_dict and state_dict hooks -------------------------------------------------


def _counting_hook(counts: List[str], kind: str) -> Callable[..., None]:
    def hook(*args: Any) -> None:
        counts.append(kind)

    return hook


LOAD_PATHS = {
    "an adopter would accept": lambda: (PyTorchLoaderAdopter("pytorch"),),
    "an adopter accepts, runs PyTorch's loader, then raises": lambda: (RaisingAfterLoaderAdopter("raising"),),
    "no adopter": lambda: (),
    "kill switch": lambda: (PyTorchLoaderAdopter("pytorch"),),
}


@pytest.mark.parametrize("kind", ["pre", "post"])
@pytest.mark.parametrize("path", list(LOAD_PATHS))
def test_each_load_state_dict_hook_runs_exactly_once(path: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hole 2: hooks run twice: with a load_state_dict hook registered, every path runs it
    exactly once, as plain ``optimizer.load_state_dict`` does, and loads the same state."""
    if path == "kill switch":
        monkeypatch.setenv(DISABLE_ENV_VAR, "1")
    upstream_counts: List[str] = []
    upstream = fresh_adam()
    getattr(upstream, f"register_load_state_dict_{kind}_hook")(_counting_hook(upstream_counts, kind))
    upstream.load_state_dict(cloned(trained_adam().state_dict()))

    counts: List[str] = []
    optimizer = fresh_adam()
    getattr(optimizer, f"register_load_state_dict_{kind}_hook")(_counting_hook(counts, kind))
    adopters = LOAD_PATHS[path]()
    outcome = load_through(optimizer, cloned(trained_adam().state_dict()), registry_of(*adopters))
    assert counts == upstream_counts == [kind]
    assert outcome.adopter is None and outcome.method == "Adam.load_state_dict"
    assert all(adopter.checked == [] for adopter in adopters)  # never offered
    rule = DISABLE_ENV_VAR if path == "kill switch" else f"a load_state_dict {kind}-hook is registered"
    assert rule in (outcome.fallback_reason or "")
    assert_same_state(optimizer, upstream)


def _raising_after_state_dict(optimizer: torch.optim.Optimizer) -> Any:
    pytorch_state_dict(optimizer)
    raise RuntimeError("failed after PyTorch's state_dict")


EXPORT_PATHS = {
    "an exporter would accept": lambda: (Exporter("good", pytorch_state_dict),),
    "an exporter runs PyTorch's state_dict, then raises": lambda: (Exporter("raising", _raising_after_state_dict),),
    "no exporter": lambda: (),
    "kill switch": lambda: (Exporter("good", pytorch_state_dict),),
}


@pytest.mark.parametrize("kind", ["pre", "post"])
@pytest.mark.parametrize("path", list(EXPORT_PATHS))
def test_each_state_dict_hook_runs_exactly_once(path: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hole 2: hooks run twice: with a state_dict hook registered, every export path runs it
    exactly once, as plain ``optimizer.state_dict()`` does."""
    if path == "kill switch":
        monkeypatch.setenv(DISABLE_ENV_VAR, "1")
    optimizer = trained_adam()
    upstream_counts: List[str] = []
    handle = getattr(optimizer, f"register_state_dict_{kind}_hook")(_counting_hook(upstream_counts, kind))
    expected = optimizer.state_dict()
    handle.remove()
    counts: List[str] = []
    getattr(optimizer, f"register_state_dict_{kind}_hook")(_counting_hook(counts, kind))
    exporters = EXPORT_PATHS[path]()
    registry = registry_of(*exporters)
    with recorded_outcomes(registry) as outcomes:
        exported = export_through(optimizer, registry)
    assert counts == upstream_counts == [kind]
    assert all(exporter.checks == 0 and exporter.exports == [] for exporter in exporters)
    assert outcomes[0].adopter is None and outcomes[0].method == "Adam.state_dict"
    assert exported["param_groups"] == expected["param_groups"] and exported["state"].keys() == expected["state"].keys()


class _HookList:
    """A hook registry that is no mapping but has the ``values()`` PyTorch iterates."""

    def __init__(self, *hooks: Callable[..., None]) -> None:
        self.hooks = list(hooks)

    def values(self) -> List[Callable[..., None]]:
        return self.hooks


@pytest.mark.parametrize(
    "attribute, hook_point",
    [
        ("_optimizer_load_state_dict_pre_hooks", "load"),
        ("_optimizer_load_state_dict_post_hooks", "load"),
        ("_optimizer_state_dict_pre_hooks", "export"),
        ("_optimizer_state_dict_post_hooks", "export"),
    ],
)
def test_a_hook_registry_that_is_no_mapping_goes_to_the_own_method(attribute: str, hook_point: str) -> None:
    """Hole 2: hook registries are read fail-safe: one that cannot be inspected counts as
    registered hooks, so the own method runs them, once."""
    counts: List[str] = []
    optimizer = trained_adam() if hook_point == "export" else fresh_adam()
    setattr(optimizer, attribute, _HookList(_counting_hook(counts, attribute)))
    adopter = Exporter("exporter", pytorch_state_dict) if hook_point == "export" else PyTorchLoaderAdopter("pytorch")
    registry = registry_of(adopter)
    with recorded_outcomes(registry) as outcomes:
        if hook_point == "load":
            load_through(optimizer, cloned(trained_adam().state_dict()), registry)
        else:
            export_through(optimizer, registry)
    assert counts == [attribute]
    (outcome,) = outcomes
    assert outcome.adopter is None and outcome.declines == ()
    assert "cannot be inspected" in (outcome.fallback_reason or "")


@pytest.mark.parametrize("attribute", ["_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"])
def test_a_missing_hook_registry_goes_to_the_own_loader_which_behaves_as_upstream(attribute: str) -> None:
    """Hole 2: an optimizer without a hook registry is not offered to adopters: its own loader
    runs as upstream (PyTorch's raises for the pre-hooks, and recreates the post-hooks in
    ``__setstate__`` before it reads them)."""

    def run(load: Callable[[torch.optim.Optimizer, Dict[str, Any]], Any]) -> tuple:
        optimizer = fresh_adam()
        delattr(optimizer, attribute)
        try:
            load(optimizer, cloned(trained_adam().state_dict()))
        except AttributeError as error:
            return optimizer, f"AttributeError: {error}"
        return optimizer, None

    upstream, upstream_error = run(lambda o, sd: o.load_state_dict(sd))
    adopter = PyTorchLoaderAdopter("pytorch")
    registry = registry_of(adopter)
    with recorded_outcomes(registry) as outcomes:
        optimizer, error = run(lambda o, sd: load_through(o, sd, registry))
    assert error == upstream_error and adopter.checked == []
    assert [(o.adopter, o.error) for o in outcomes] == [(None, upstream_error)]
    assert "cannot be inspected" in (outcomes[0].fallback_reason or "")
    assert_same_state(optimizer, upstream)


class _SlotsOptimizer:
    """An optimizer object without an instance ``__dict__`` (``__slots__``) and without PyTorch's
    hook registries; upstream calls its ``load_state_dict``/``state_dict`` like any other."""

    __slots__ = ("param_groups", "state", "calls")

    def __init__(self, params: List[torch.nn.Parameter]) -> None:
        self.param_groups = [{"params": params, "lr": 0.1}]
        self.state: Dict[Any, Dict[str, Any]] = {}
        self.calls: List[str] = []

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.calls.append("load_state_dict")
        ids = state_dict["param_groups"][0]["params"]
        for state_id, param in zip(ids, self.param_groups[0]["params"]):
            self.state[param] = dict(state_dict["state"][state_id])

    def state_dict(self) -> Dict[str, Any]:
        self.calls.append("state_dict")
        params = self.param_groups[0]["params"]
        state = {index: dict(self.state[param]) for index, param in enumerate(params) if param in self.state}
        return {"state": state, "param_groups": [{"params": list(range(len(params))), "lr": 0.1}]}


@pytest.mark.parametrize("hook_point", ["load", "export"])
def test_an_optimizer_without_an_instance_dict_gets_its_own_method_once(hook_point: str) -> None:
    """An optimizer whose instance has no ``__dict__`` (so nothing can be set on it) and
    no hook registries is read fail-safe: its own method runs, once, as upstream calls it."""
    optimizer = _SlotsOptimizer([torch.nn.Parameter(torch.ones(3))])
    incoming = torch.ones(3)
    state_dict = {"state": {0: {"momentum_buffer": incoming}}, "param_groups": [{"params": [0], "lr": 0.1}]}
    adopter = PyTorchLoaderAdopter("any_object", object)
    registry = registry_of(adopter)
    with recorded_outcomes(registry) as outcomes:
        if hook_point == "load":
            load_through(optimizer, state_dict, registry)  # type: ignore[arg-type]
        else:
            optimizer.load_state_dict(state_dict)
            optimizer.calls.clear()
            exported = export_through(optimizer, registry)  # type: ignore[arg-type]
            assert exported["state"][0]["momentum_buffer"] is incoming
    method = "load_state_dict" if hook_point == "load" else "state_dict"
    assert optimizer.calls == [method] and adopter.checked == []
    (outcome,) = outcomes
    assert outcome.method == f"_SlotsOptimizer.{method}" and outcome.error is None
    assert outcome.fallback_reason == f"the optimizer's {method} pre-hooks cannot be inspected"
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (12, 0)


def test_an_own_state_dict_that_is_no_mapping_is_returned_as_upstream_gets_it() -> None:
    """Upstream hands on whatever the inner ``state_dict()`` returns; so does the export, with
    an outcome that measures nothing in it."""

    class PairsAdam(torch.optim.Adam):
        def state_dict(self) -> Any:  # type: ignore[override]
            return tuple(torch.optim.Adam.state_dict(self).items())

    optimizer = PairsAdam(fresh_adam().param_groups)
    registry = registry_of(Exporter("exporter", pytorch_state_dict, decline="no"))
    with recorded_outcomes(registry) as outcomes:
        exported: Any = export_through(optimizer, registry)
    assert isinstance(exported, tuple) and [key for key, _ in exported] == ["state", "param_groups"]
    (outcome,) = outcomes
    assert outcome.method == "PairsAdam.state_dict" and outcome.error is None
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (0, 0)


class _WatchingStandIn(FusedAdamStandIn):
    """Counts, when its own loader finishes, how many of the ``watched`` tensors were freed."""

    watched: List["weakref.ref[torch.Tensor]"] = []
    freed_by_the_end_of_the_load: Optional[int] = None

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.freed_by_the_end_of_the_load = sum(ref() is None for ref in self.watched)


def _resumed_watching_standin() -> _WatchingStandIn:
    """A stand-in holding state only it references, every state tensor watched."""
    optimizer = _WatchingStandIn(fresh_standin().param_groups, lr=1e-3)
    optimizer.load_state_dict(cloned_state_dict(trained_standin()))
    optimizer.watched = [weakref.ref(tensor) for tensor in state_tensors(optimizer)]
    return optimizer


def test_the_own_loader_frees_the_state_it_replaces_during_the_call_as_upstream() -> None:
    """The loader keeps the earlier state only weakly (to measure the call), so the own loader
    frees what it replaces while it runs, as upstream's call does: the peak stays upstream's."""
    upstream = _resumed_watching_standin()
    upstream.load_state_dict(cloned_state_dict(trained_standin()))
    optimizer = _resumed_watching_standin()
    outcome = load_through(optimizer, cloned_state_dict(trained_standin()), registry_of())
    assert outcome.method == "_WatchingStandIn.load_state_dict"
    assert optimizer.freed_by_the_end_of_the_load == upstream.freed_by_the_end_of_the_load == 8


# --- errors are upstream's, with an outcome -----------------------------------------------


def _fewer_groups(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    return {**state_dict, "param_groups": state_dict["param_groups"][:1]}


def _fewer_params(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    state_dict["param_groups"][1]["params"].pop()
    return state_dict


ERRORS = {
    "fewer param groups": (_fewer_groups, ValueError),
    "fewer params in a group": (_fewer_params, ValueError),
    "no param_groups": (lambda sd: {"state": sd["state"]}, KeyError),
}


@pytest.mark.parametrize("adopters", ["none", "the stand-in adopter", "an adopter that fails first"])
@pytest.mark.parametrize("case", list(ERRORS))
def test_an_error_of_the_own_loader_propagates_and_is_an_outcome(case: str, adopters: str) -> None:
    """Hole 3: the own loader raises: the exception propagates as upstream raises it, and an
    outcome with ``error`` set reaches the outcome hooks."""
    corrupt, error = ERRORS[case]
    with pytest.raises(error) as upstream:
        fresh_standin().load_state_dict(corrupt(cloned_state_dict(trained_standin())))
    registry = {
        "none": registry_of(),
        "the stand-in adopter": standin_registry(),
        "an adopter that fails first": registry_of(RaisingAfterLoaderAdopter("raising")),
    }[adopters]
    with recorded_outcomes(registry) as outcomes, pytest.raises(error) as ours:
        load_through(fresh_standin(), corrupt(cloned_state_dict(trained_standin())), registry)
    assert str(ours.value) == str(upstream.value)
    (outcome,) = outcomes
    assert outcome.error == f"{error.__name__}: {upstream.value}"
    assert outcome.adopter is None and outcome.method == "FusedAdamStandIn.load_state_dict"
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (0, 0)


class _Abort(BaseException):
    """Raised by an optimizer's own method; a BaseException that is no Exception."""


class _FailingAdam(torch.optim.Adam):
    """An Adam whose own ``load_state_dict`` and ``state_dict`` raise ``error``."""

    error: Optional[BaseException] = None

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        assert self.error is not None
        raise self.error

    def state_dict(self) -> Dict[str, Any]:
        assert self.error is not None
        raise self.error


@pytest.mark.parametrize("error", [RuntimeError("disk gone"), _Abort("stop"), KeyboardInterrupt()], ids=type)
@pytest.mark.parametrize("hook_point", ["load", "export"])
def test_the_very_exception_of_the_own_method_propagates_with_an_outcome(hook_point: str, error: BaseException) -> None:
    """Hole 3: also a BaseException subclass propagates unchanged (the same object) from the own
    ``load_state_dict`` or ``state_dict``, after an outcome recording it reached the hooks."""
    optimizer = _FailingAdam(fresh_adam().param_groups)
    optimizer.error = error
    registry = registry_of(DecliningAdopter("declining"), Exporter("exporter", pytorch_state_dict, decline="no"))
    with recorded_outcomes(registry) as outcomes, pytest.raises(type(error)) as raised:
        if hook_point == "load":
            load_through(optimizer, cloned(trained_adam().state_dict()), registry)
        else:
            export_through(optimizer, registry)
    assert raised.value is error
    (outcome,) = outcomes
    method = "load_state_dict" if hook_point == "load" else "state_dict"
    assert outcome.hook_point == hook_point and outcome.method == f"_FailingAdam.{method}"
    assert outcome.error == f"{type(error).__name__}: {error}"


def test_an_instance_loader_that_raises_propagates_with_an_outcome() -> None:
    optimizer = fresh_adam()
    failure = RuntimeError("bridge loader failed")

    def load_state_dict(self: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        raise failure

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]
    registry = registry_of()
    with recorded_outcomes(registry) as outcomes, pytest.raises(RuntimeError) as raised:
        load_through(optimizer, cloned(trained_adam().state_dict()), registry)
    assert raised.value is failure
    assert [(o.method, o.error) for o in outcomes] == [
        ("load_state_dict set on the Adam instance", "RuntimeError: bridge loader failed")
    ]


# --- Transformer Engine generations -------------------------------------------------------


@pytest.mark.parametrize(
    "release, te_version",
    [((1, 13), "1.13.0"), ((1, 13), "1.14.0"), ((2, 0), "2.0.0"), ((2, 1), "2.1.0"), ((2, 20), "2.20.2")],
    ids=lambda value: str(value),
)
def test_adoption_gives_each_te_generation_what_its_own_loader_gives(release: tuple, te_version: str) -> None:
    adopter = TEFusedAdamFP32StateAdopter(FusedAdamStandIn, param_device_type="cpu", te_version=te_version)
    optimizer, by_te = fresh_standin(te_release=release), fresh_standin(te_release=release)
    outcome = load_through(optimizer, cloned_state_dict(trained_standin()), registry_of(adopter))
    by_te.load_state_dict(cloned_state_dict(trained_standin()))
    assert outcome.adopter == "te_fused_adam_fp32" and optimizer.allocations == 0
    assert_bitwise_equal(state_tensors(optimizer), state_tensors(by_te))
    assert optimizer.param_groups[1]["step"] == by_te.param_groups[1]["step"] == 2


def test_te_1_13s_loader_fails_on_a_none_value_and_so_does_the_load() -> None:
    """A None state value is not adopted (exact keys with tensors), so TE's own error surfaces."""

    def payload() -> Dict[str, Any]:
        state_dict = cloned_state_dict(trained_standin())
        state_dict["state"][0]["exp_avg"] = None
        return state_dict

    adopter = TEFusedAdamFP32StateAdopter(FusedAdamStandIn, param_device_type="cpu", te_version="1.13.0")
    with pytest.raises(AttributeError) as upstream:
        fresh_standin(te_release=(1, 13)).load_state_dict(payload())
    with pytest.raises(AttributeError) as ours:
        load_through(fresh_standin(te_release=(1, 13)), payload(), registry_of(adopter))
    assert str(ours.value) == str(upstream.value)
