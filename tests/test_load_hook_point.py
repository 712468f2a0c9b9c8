"""The load hook point: which adopter installs the state, what the outcome records, what is logged.

``load_inner_optimizer_state_dict`` offers the load to the registered adopters in order; the
first that accepts installs the state, and otherwise the optimizer's own ``load_state_dict``
runs. Every call ends in one outcome, returned and handed to the outcome hooks, whose byte
counts are measured after the call from storage identity. Real ``torch.optim`` optimizers;
TE's FusedAdam is reproduced by ``FusedAdamStandIn``, whose loader allocates and copies.
"""

import gc
import logging
import threading
import types
from typing import Any, Dict, List, Optional

import pytest
import torch
from adopters_for_tests import CopyingAdopter, DecliningAdopter, PyTorchLoaderAdopter
from builders import (
    registry_of,
    load_through,
    cloned_state_dict,
    fresh_standin,
    numel_bytes,
    standin_adopter,
    standin_registry,
    state_tensors,
    trained_standin,
)
from outcome_recording import recorded_outcomes
from real_optimizers import (
    assert_same_state,
    cloned,
    fresh_adam,
    held_state,
    state_bytes,
    trained_adam,
)

from megatron.core.optimizer.state_adoption import (
    StateAdoptionContext,
)

LOGGER = "megatron.core.optimizer.state_adoption"
STANDIN_BYTES = 8 * 232  # FP32 exp_avg and exp_avg_sq of the stand-in's 232 parameter elements


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER) and r.levelno == level]


# --- routing ------------------------------------------------------------------------------


def test_the_first_accepting_adopter_installs_the_state_and_later_ones_are_not_asked() -> None:
    declining = DecliningAdopter("declining", "not mine")
    first, second = PyTorchLoaderAdopter("first"), PyTorchLoaderAdopter("second")
    registry = registry_of(declining, first, second)
    optimizer, payload = fresh_adam(), cloned(trained_adam().state_dict())
    with recorded_outcomes(registry) as outcomes:
        outcome = load_through(optimizer, payload, registry)
    assert outcome.adopter == "first" and outcome.method is None and outcome.fallback_reason is None
    assert outcome.declines == (("declining", "not mine"),) and outcome.error is None
    assert outcomes == [outcome]  # exactly one outcome per call, the one returned
    assert len(first.adopted) == 1 and second.checked == []
    reference = fresh_adam()
    reference.load_state_dict(cloned(trained_adam().state_dict()))
    assert_same_state(optimizer, reference)


@pytest.mark.parametrize(
    "adopters, reason, declines",
    [
        ((), "no adopter is registered", ()),
        (
            (DecliningAdopter("a", "reason a"), DecliningAdopter("b", "reason b")),
            "every adopter declined",
            (("a", "reason a"), ("b", "reason b")),
        ),
    ],
    ids=["no adopter", "all decline"],
)
def test_the_own_loader_runs_when_no_adopter_accepts(adopters: tuple, reason: str, declines: tuple) -> None:
    registry = registry_of(*adopters)
    optimizer = fresh_standin()
    with recorded_outcomes(registry) as outcomes:
        outcome = load_through(optimizer, cloned_state_dict(trained_standin()), registry)
    assert outcomes == [outcome]
    assert outcome.adopter is None and outcome.method == "FusedAdamStandIn.load_state_dict"
    assert outcome.fallback_reason == reason and outcome.declines == declines
    assert optimizer.allocations == 8  # TE's loader allocated every moment


class _BlockingAdopter:
    """Declines, but only after the test thread said so; lets a load be caught mid-way."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.entered = threading.Event()
        self.release = threading.Event()

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        self.entered.set()
        assert self.release.wait(timeout=30)
        return "blocked, then declined"

    def adopt(self, context: StateAdoptionContext) -> None:
        raise AssertionError("never accepts")


def test_a_load_uses_the_registrations_it_started_with() -> None:
    blocking = _BlockingAdopter("blocking")
    registry = registry_of(blocking)
    handle = registry.register(standin_adopter())
    optimizer = fresh_standin()
    results: List[Any] = []
    loader = threading.Thread(
        target=lambda: results.append(load_through(optimizer, cloned_state_dict(trained_standin()), registry))
    )
    loader.start()
    assert blocking.entered.wait(timeout=30)
    handle.remove()  # removed while the load is in progress: the load keeps its snapshot
    registry.register(_BlockingAdopter("late_blocking"), prepend=True)
    blocking.release.set()
    loader.join(timeout=30)
    assert not loader.is_alive() and len(results) == 1
    assert results[0].adopter == "te_fused_adam_fp32" and optimizer.allocations == 0
    assert [r.name for r in registry.registrations()] == ["late_blocking", "blocking"]


def test_repeated_loads_do_not_grow_python_objects() -> None:
    registry = standin_registry()
    optimizer = trained_standin()

    def cycle() -> None:
        load_through(optimizer, cloned_state_dict(optimizer), registry)
        load_through(optimizer, optimizer.state_dict(), registry)

    for _ in range(3):
        cycle()
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(20):
        cycle()
    gc.collect()
    assert len(gc.get_objects()) <= before


# --- measured bytes -----------------------------------------------------------------------


def test_the_default_adopter_is_measured_as_installing_by_reference() -> None:
    """Hole 6: the saving is observed: the stand-in adopter reuses 8 B per parameter element."""
    optimizer = fresh_standin()
    outcome = load_through(optimizer, cloned_state_dict(trained_standin()), standin_registry())
    assert outcome.adopter == "te_fused_adam_fp32"
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (numel_bytes(optimizer), 0) == (STANDIN_BYTES, 0)
    assert optimizer.allocations == 0


def test_an_adopter_that_installs_copies_is_measured_as_allocating() -> None:
    """Hole 6: the figure is measured, not the adopter's claim: copies count as allocated."""
    optimizer = fresh_standin()
    outcome = load_through(optimizer, cloned_state_dict(trained_standin()), registry_of(CopyingAdopter()))
    assert outcome.adopter == "copying"
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (0, STANDIN_BYTES)


@pytest.mark.parametrize("make_optimizer", [fresh_standin, trained_standin], ids=["fresh", "holding state"])
def test_tes_own_loader_is_measured_as_allocating(make_optimizer) -> None:
    """Hole 6: TE's loader (stand-in) allocates 8 B per parameter element and reuses nothing,
    also when the state it replaces is freed during the call: the allocator may give its
    addresses to TE's new tensors (measured by address alone, about one load in four of a
    trained optimizer read as partly reused, so thirty loads)."""
    for _ in range(30):
        optimizer = make_optimizer()
        outcome = load_through(optimizer, cloned_state_dict(trained_standin()), registry_of())
        assert outcome.method == "FusedAdamStandIn.load_state_dict"
        assert (outcome.reused_bytes, outcome.allocated_bytes) == (0, STANDIN_BYTES), outcome


def test_an_instance_loader_that_installs_by_reference_is_recorded_as_such() -> None:
    """Hole 6: under an instance-level loader (Megatron-Bridge's pattern) the outcome names that
    method and measures its by-reference install, instead of reading as "0 bytes"."""
    optimizer = fresh_standin()

    def load_state_dict(self: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
        torch.optim.Optimizer.load_state_dict(self, state_dict)

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]
    outcome = load_through(optimizer, cloned_state_dict(trained_standin()), standin_registry())
    assert outcome.adopter is None
    assert outcome.method == "load_state_dict set on the FusedAdamStandIn instance"
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (STANDIN_BYTES, 0)


def test_two_optimizers_of_one_class_and_size_get_different_labels() -> None:
    """Hole 6: outcomes tell a ChainedOptimizer's dense and expert optimizers apart."""
    registry = standin_registry()
    dense, expert = fresh_standin(), fresh_standin()
    labels = [load_through(o, cloned_state_dict(trained_standin()), registry).optimizer for o in (dense, expert)]
    assert labels[0] != labels[1]
    for label, optimizer in zip(labels, (dense, expert)):
        assert label == f"FusedAdamStandIn {id(optimizer):#x} (4 params, 232 elements)"


def test_each_load_of_one_resume_reports_its_own_figure() -> None:
    """Hole 6: the scaffold load and the payload load each report the bytes of that call; the
    payload pass re-installs the optimizer's own tensors, and so does a load after a step."""
    registry = standin_registry()
    optimizer = fresh_standin()
    scaffold = load_through(optimizer, cloned_state_dict(trained_standin()), registry)
    first = state_tensors(optimizer)
    payload = load_through(optimizer, optimizer.state_dict(), registry)
    assert all(a is b for a, b in zip(state_tensors(optimizer), first))
    for param in (p for g in optimizer.param_groups for p in g["params"]):
        param.grad = torch.ones_like(param)
    optimizer.step()
    after_step = load_through(optimizer, optimizer.state_dict(), registry)
    assert all(a is b for a, b in zip(state_tensors(optimizer), first))
    for outcome in (scaffold, payload, after_step):
        assert outcome.adopter == "te_fused_adam_fp32"
        assert (outcome.reused_bytes, outcome.allocated_bytes) == (STANDIN_BYTES, 0)
    assert optimizer.allocations == 0


def test_non_moment_state_is_measured_too() -> None:
    """Adam's 0-d ``step`` tensors are state bytes like the moments."""
    optimizer = fresh_adam()
    outcome = load_through(optimizer, cloned(trained_adam().state_dict()), registry_of(PyTorchLoaderAdopter("pytorch")))
    assert outcome.reused_bytes == state_bytes(optimizer) == 4 * (2 * 23 + 4) and outcome.allocated_bytes == 0
    assert all(entry[2].dim() == 0 for entry in held_state(optimizer) if entry[1] == "step")


class _ShardedStandIn(torch.Tensor):
    """A DTensor as the loader sees it (Megatron-FSDP keeps DTensor state): a tensor of the
    global shape without an accessible storage, whose bytes on this rank are its local shard's,
    returned by ``to_local()``."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, global_numel: int) -> "_ShardedStandIn":
        wrapper = torch.Tensor._make_wrapper_subclass(cls, (global_numel,), dtype=local.dtype)  # type: ignore[attr-defined]
        wrapper.local = local
        return wrapper  # type: ignore[no-any-return]

    def to_local(self) -> torch.Tensor:
        return self.local  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{func} on a sharded stand-in")


def test_dtensor_state_is_measured_by_its_local_shard() -> None:
    """With DTensor state the figure is this rank's: the local shards' bytes (2 of 8
    elements here), not nothing (the wrapper has no storage) nor the global size."""
    param = torch.nn.Parameter(torch.ones(8))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    shard = torch.ones(2)
    payload = {"state": {0: {"momentum_buffer": _ShardedStandIn(shard, 8)}}, "param_groups": optimizer.state_dict()["param_groups"]}
    outcome = load_through(optimizer, payload, registry_of(PyTorchLoaderAdopter("pytorch")))
    assert outcome.adopter == "pytorch" and optimizer.state[param]["momentum_buffer"].to_local() is shard
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (8, 0)


def test_a_state_tensor_without_elements_counts_nothing_and_the_others_still_count() -> None:
    """A parameter shard can be empty; its state counts 0 B and the count goes on after it."""
    params = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    payload = {
        "state": {0: {"momentum_buffer": torch.zeros(0)}, 1: {"momentum_buffer": torch.ones(3)}},
        "param_groups": optimizer.state_dict()["param_groups"],
    }
    outcome = load_through(optimizer, payload, registry_of(PyTorchLoaderAdopter("pytorch")))
    assert outcome.adopter == "pytorch" and (outcome.reused_bytes, outcome.allocated_bytes) == (12, 0)


def test_tensors_on_the_meta_device_are_new_state_also_next_to_an_empty_one() -> None:
    """A load onto meta-device parameters (deferred initialisation) makes new tensors. They have
    no storage address (0), as an empty tensor has none: an empty incoming value must not make
    them look like state that existed before."""
    params = [torch.nn.Parameter(torch.empty(0, device="meta")), torch.nn.Parameter(torch.empty(3, device="meta"))]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    payload = {
        "state": {0: {"momentum_buffer": torch.zeros(0)}, 1: {"momentum_buffer": torch.ones(3)}},
        "param_groups": optimizer.state_dict()["param_groups"],
    }
    outcome = load_through(optimizer, payload, registry_of())
    assert outcome.method == "SGD.load_state_dict" and optimizer.state[params[1]]["momentum_buffer"].is_meta
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (0, 12)


class _FrugalSGD(torch.optim.SGD):
    """An SGD whose own loader copies each incoming tensor and frees the incoming buffer right
    away (``untyped_storage().resize_(0)``, as Megatron frees buffers), so the next copy may get
    the freed address while the incoming tensor object is still alive."""

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        copied: Dict[Any, Dict[str, Any]] = {}
        for key, entry in state_dict["state"].items():
            copied[key] = {}
            for name, value in entry.items():
                copied[key][name] = value.clone()
                value.untyped_storage().resize_(0)
        super().load_state_dict({"state": copied, "param_groups": state_dict["param_groups"]})


def test_an_address_freed_and_reused_during_the_call_counts_as_allocated() -> None:
    """An incoming tensor that gave up its storage during the call no longer holds its
    old address, so a new tensor that got that address is newly allocated, not reused (the
    allocator hands a freed block of the same size to the next copy: ten loads)."""
    for _ in range(10):
        optimizer = _FrugalSGD([torch.nn.Parameter(torch.ones(4096)) for _ in range(4)], lr=0.1, momentum=0.9)
        payload = {
            "state": {i: {"momentum_buffer": torch.full((4096,), float(i))} for i in range(4)},
            "param_groups": optimizer.state_dict()["param_groups"],
        }
        outcome = load_through(optimizer, payload, registry_of())
        assert outcome.method == "_FrugalSGD.load_state_dict"
        assert (outcome.reused_bytes, outcome.allocated_bytes) == (0, 4 * 4 * 4096), outcome


class _NoWeakReferences:
    """A tensor proxy that passes ``isinstance(value, torch.Tensor)`` but, like an extension
    type without a weak-reference slot, cannot be weakly referenced."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    def untyped_storage(self) -> Any:
        return self.tensor.untyped_storage()


class _VerbatimSGD(torch.optim.SGD):
    """An SGD whose own loader installs the incoming state entries as they are."""

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for state_id, param in zip(ids, [p for g in self.param_groups for p in g["params"]]):
            self.state[param] = dict(state_dict["state"][state_id])


def test_state_values_that_cannot_be_weakly_referenced_are_measured_too() -> None:
    """The loader holds the earlier state weakly; a value that refuses weak references is held
    for the call instead, and counted as the reused bytes it is."""
    optimizer = _VerbatimSGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
    proxy = _NoWeakReferences(torch.ones(3))
    payload = {"state": {0: {"momentum_buffer": proxy}}, "param_groups": optimizer.state_dict()["param_groups"]}
    outcome = load_through(optimizer, payload, registry_of())
    assert outcome.method == "_VerbatimSGD.load_state_dict"
    assert next(iter(optimizer.state.values()))["momentum_buffer"] is proxy
    assert (outcome.reused_bytes, outcome.allocated_bytes) == (12, 0)


# --- logging ------------------------------------------------------------------------------


def test_an_adoption_is_logged_at_info_with_the_measured_bytes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    registry = registry_of(DecliningAdopter("declining", "not mine"), standin_adopter())
    outcome = load_through(fresh_standin(), cloned_state_dict(trained_standin()), registry)
    (info,) = _messages(caplog, logging.INFO)
    assert "'te_fused_adam_fp32' installed" in info and outcome.optimizer in info
    assert "1,856 B by reference, 0 B newly allocated" in info
    (debug,) = _messages(caplog, logging.DEBUG)
    assert "'declining'" in debug and "not mine" in debug
    assert _messages(caplog, logging.WARNING) == []


def test_the_own_loader_is_logged_at_info_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    outcome = load_through(fresh_standin(), cloned_state_dict(trained_standin()), registry_of())
    (info,) = _messages(caplog, logging.INFO)
    assert "FusedAdamStandIn.load_state_dict" in info and outcome.optimizer in info
    assert "no adopter is registered" in info and "0 B by reference, 1,856 B newly allocated" in info


def test_large_figures_are_logged_in_mib(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    param = torch.nn.Parameter(torch.zeros(2**18))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    payload = {"state": {0: {"momentum_buffer": torch.ones(2**18)}}, "param_groups": optimizer.state_dict()["param_groups"]}
    load_through(optimizer, payload, registry_of(PyTorchLoaderAdopter("pytorch")))
    (info,) = _messages(caplog, logging.INFO)
    assert "1.0 MiB by reference, 0 B newly allocated" in info
