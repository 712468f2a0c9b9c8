"""The functions Megatron-Core's optimizers call while they load a checkpoint.

:func:`load_inner_optimizer_state_dict` stands wherever MCore hands loaded state to the inner
optimizer's ``load_state_dict``: both branches of ``DistributedOptimizer.load_state_dict``
(its shards, and Megatron-FSDP's DTensors) and the ``load_state_dict`` of
``Float16OptimizerWithFloat16Params`` and ``FP32Optimizer`` (without the distributed optimizer).
:func:`export_inner_optimizer_state_dict` stands where ``DistributedOptimizer.load_state_dict``
reads the inner optimizer's state dict, :func:`initialize_inner_optimizer_state` where
Megatron-FSDP creates the state a checkpoint is read into (upstream: a dummy ``step()`` on zero
gradients, which hold 4 bytes per FP32 parameter on top of the new state). Each offers the call
to the registered adopters (exporters, initializers) in order; the first that accepts handles
it. The optimizer's own code runs, exactly as it would without this module, when

* adoption is switched off: ``OptimizerConfig.optimizer_state_adoption = False``, or, for the
  drop-in build, ``MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION=1`` (an unrecognised value switches
  it off too, with a warning);
* the optimizer *instance* carries its own method (a wrapper, Megatron-Bridge's loader), or
  has hooks for it registered: upstream would run them, exactly once (for the initialisation:
  its ``step`` and step hooks, global ones included; and when it already holds state);
* no adopter accepts (``MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS=name,...`` skips adopters by
  name), or the accepting one fails (the optimizer is then restored first).

Every call ends in a :class:`~.outcome.StateAdoptionOutcome` with the bytes installed by
reference and newly allocated, measured from storage identity, also when the own code raises.

The read hook point: while a precision-aware ``DistributedOptimizer`` builds its
``dp_reshardable`` sharded state dict for loading (:func:`reading_optimizer_state`), each state
tensor it reads into comes from :func:`unscaled_state_or_read_target` -- the first accepting
:class:`~.adopter.StateReadTargetProvider`'s target (e.g. the held BF16 tensor itself), or
upstream's FP32 copy from ``get_unscaled_state``. After the read, the loaded values go to the
held state through :func:`store_read_optimizer_state`, which leaves a tensor read in place as
it is.
"""

import logging
import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
    Union,
    cast,
)

import torch
from torch.optim import optimizer as torch_optimizer_module

from megatron.core.utils import log_single_rank

from .adopter import (
    StateAdoptionContext,
    StateExportContext,
    StateExporter,
    StateInitializer,
    StateReadTargetProvider,
)
from .outcome import StateAdoptionOutcome
from .registry import StateAdopterRegistration, StateAdopterRegistry, default_registry
from .validation import exported_state_dict_decline_reason, installed_state_decline_reason

__all__ = [
    "export_inner_optimizer_state_dict",
    "initialize_inner_optimizer_state",
    "load_inner_optimizer_state_dict",
    "reading_optimizer_state",
    "store_read_optimizer_state",
    "unscaled_state_or_read_target",
]

logger = logging.getLogger(__name__)

_CONFIG_SWITCH = "optimizer_state_adoption"
_DISABLE_ENV_VAR = "MCORE_DISABLE_OPTIMIZER_STATE_ADOPTION"
_DISABLED_ADOPTERS_ENV_VAR = "MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS"
_SWITCH_ON_VALUES = frozenset(("1", "true", "yes", "on"))
_SWITCH_OFF_VALUES = frozenset(("", "0", "false", "no", "off"))
_LOAD, _EXPORT, _INITIALIZE, _READ = "load", "export", "initialize", "read"
_METHODS = {_LOAD: "load_state_dict", _EXPORT: "state_dict"}
_VERBS = {
    _LOAD: "installed",
    _EXPORT: "exported",
    _INITIALIZE: "initialized",
    _READ: "supplied the read targets for",
}

_warned: Set[str] = set()


def _warn_once(message: str) -> None:
    """Log a configuration problem once per process (every load would repeat it)."""
    if message not in _warned:
        _warned.add(message)
        log_single_rank(logger, logging.WARNING, message)


def _check_environment_names() -> None:
    """Warn about environment variables that look like a state-adoption setting but are none."""
    known = (_DISABLE_ENV_VAR, _DISABLED_ADOPTERS_ENV_VAR)
    for name in os.environ:
        if "STATE_ADOPT" in name.upper() and name not in known:
            _warn_once(
                f"The environment variable {name} is not a setting of optimizer state adoption "
                f"and is ignored; the settings are {' and '.join(known)}"
            )


def _switched_off_reason(config: Any) -> Optional[str]:
    """Why adoption is switched off for an owner with ``config``, or None if it is on."""
    _check_environment_names()
    raw = os.environ.get(_DISABLE_ENV_VAR)
    if raw is not None:
        value = raw.strip().lower()
        if value in _SWITCH_ON_VALUES:
            return f"{_DISABLE_ENV_VAR}={raw} is set"
        if value not in _SWITCH_OFF_VALUES:
            _warn_once(
                f"{_DISABLE_ENV_VAR}={raw!r} is none of 1, true, yes, on (switch off) or 0, "
                "false, no, off; optimizer state adoption is switched off to be safe"
            )
            return f"{_DISABLE_ENV_VAR}={raw!r} is not recognised, so adoption is off"
    enabled = getattr(config, _CONFIG_SWITCH, True)
    if enabled is True:
        return None
    if enabled is not False:
        _warn_once(
            f"OptimizerConfig.{_CONFIG_SWITCH}={enabled!r} is not a bool; optimizer state "
            "adoption is switched off to be safe"
        )
    return f"OptimizerConfig.{_CONFIG_SWITCH} is {enabled!r}"


def _disabled_adopter_names(registrations: Iterable[StateAdopterRegistration]) -> FrozenSet[str]:
    """The names in ``MCORE_DISABLED_OPTIMIZER_STATE_ADOPTERS``; unknown ones are reported."""
    listed = os.environ.get(_DISABLED_ADOPTERS_ENV_VAR, "")
    names = frozenset(name.strip() for name in listed.split(",") if name.strip())
    registered = sorted(registration.name for registration in registrations)
    unknown = sorted(names.difference(registered))
    if unknown:
        _warn_once(
            f"{_DISABLED_ADOPTERS_ENV_VAR} names {', '.join(unknown)}, which no registered "
            f"optimizer state adopter has (registered: {', '.join(registered) or 'none'})"
        )
    return names


def _instance_method_reason(optimizer: torch.optim.Optimizer, method: str) -> Optional[str]:
    """Why ``method`` set on the optimizer *instance* (e.g. by a wrapper) must run, or None."""
    if method in getattr(optimizer, "__dict__", {}):
        return (
            f"the {type(optimizer).__name__} instance has its own {method} (set on the "
            "instance, e.g. by a wrapper), which upstream calls"
        )
    return None


def _own_method_reason(
    owner: Any, optimizer: torch.optim.Optimizer, hook_point: str
) -> Optional[str]:
    """Why the optimizer's own method must run without consulting adopters, or None.

    Hooks are read fail-safe: registries that cannot be inspected count as registered hooks.
    """
    reason = _switched_off_reason(getattr(owner, "config", None))
    if reason is not None:
        return reason
    method = _METHODS[hook_point]
    reason = _instance_method_reason(optimizer, method)
    if reason is not None:
        return reason
    for kind in ("pre", "post"):
        hooks = getattr(optimizer, f"_optimizer_{method}_{kind}_hooks", None)
        if not isinstance(hooks, Mapping):
            return f"the optimizer's {method} {kind}-hooks cannot be inspected"
        if len(hooks) > 0:
            return f"a {method} {kind}-hook is registered, which the own {method} runs"
    return None


def _describe(optimizer: torch.optim.Optimizer) -> str:
    """Name the inner optimizer so that a ChainedOptimizer's optimizers differ in the logs."""
    name = f"{type(optimizer).__name__} {id(optimizer):#x}"
    try:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        elements = sum(_local(p).numel() for p in params)
    except Exception:  # a malformed optimizer is reported by its own loader
        return name
    return f"{name} ({len(params)} params, {elements:,} elements)"


def _state_tensors(state: Any) -> List[torch.Tensor]:
    """Every tensor value of a ``{key: {name: value}}`` state mapping."""
    tensors = []
    if isinstance(state, Mapping):
        for entry in state.values():
            if isinstance(entry, Mapping):
                for value in entry.values():
                    if isinstance(value, torch.Tensor):
                        tensors.append(value)
    return tensors


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a DTensor's local shard."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _storage(tensor: torch.Tensor) -> Optional[int]:
    """The address of ``tensor``'s storage; None for an empty or storage-less tensor."""
    try:
        return int(tensor.untyped_storage().data_ptr()) if tensor.nbytes > 0 else None
    except Exception:  # e.g. a tensor subclass without a storage
        return None


_Existing = List[Tuple[Callable[[], Optional[torch.Tensor]], int]]


def _strong_reference(tensor: torch.Tensor) -> Callable[[], Optional[torch.Tensor]]:
    """A callable returning ``tensor``, in place of a weak reference to it."""
    return lambda: tensor


def _existing_storages(*states: Any) -> _Existing:
    """The state tensors of the given state mappings before a call, each with its storage.

    They are held weakly, so that the call frees what upstream's call frees. A freed storage's
    address can be given to a tensor the call allocates, so :func:`_measure` counts an address
    as existing only while a tensor that held it before the call is alive and still holds it.
    """
    existing: _Existing = []
    for state in states:
        for tensor in _state_tensors(state):
            storage = _storage(_local(tensor))
            if storage is not None:
                reference: Callable[[], Optional[torch.Tensor]]
                try:
                    reference = weakref.ref(tensor)
                except TypeError:  # a tensor type without weak references is held strongly
                    reference = _strong_reference(tensor)
                existing.append((reference, storage))
    return existing


def _measure(state: Any, existing: _Existing) -> Tuple[int, int]:
    """(bytes in tensors whose storage existed before, bytes in new tensors) of ``state``."""
    return _measure_tensors(_state_tensors(state), existing)


def _measure_tensors(tensors: Iterable[torch.Tensor], existing: _Existing) -> Tuple[int, int]:
    """(bytes in tensors whose storage existed before, bytes in new tensors) of ``tensors``."""
    alive = set()
    for reference, address in existing:
        held = reference()
        if held is not None and _storage(_local(held)) == address:
            alive.add(address)
    reused = allocated = 0
    for tensor in map(_local, tensors):
        storage = _storage(tensor)
        if storage is None:
            continue
        if storage in alive:
            reused += tensor.nbytes
        else:
            allocated += tensor.nbytes
    return reused, allocated


@dataclass
class _OptimizerSnapshot:
    """The containers of an optimizer's ``state`` and ``param_groups``, for a rollback.

    Tensors are kept by reference; the dicts and lists holding them are copied so that a
    failed adoption can be undone even if it mutated them in place.
    """

    state: Any
    state_entries: List[Tuple[Any, Any, Dict[Any, Any]]]
    param_groups: List[Dict[str, Any]]
    param_group_entries: List[Dict[str, Any]]
    param_lists: List[List[Any]]

    @classmethod
    def capture(cls, optimizer: torch.optim.Optimizer) -> "_OptimizerSnapshot":
        """Record ``optimizer``'s state containers."""
        return cls(
            state=optimizer.state,
            state_entries=[(key, value, dict(value)) for key, value in optimizer.state.items()],
            param_groups=list(optimizer.param_groups),
            param_group_entries=[dict(group) for group in optimizer.param_groups],
            param_lists=[list(group["params"]) for group in optimizer.param_groups],
        )

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Put ``optimizer``'s state containers back as they were captured."""
        self.state.clear()
        for key, value, entries in self.state_entries:
            value.clear()
            value.update(entries)
            self.state[key] = value
        for group, entries, params in zip(
            self.param_groups, self.param_group_entries, self.param_lists
        ):
            group.clear()
            group.update(entries)
            group["params"][:] = params
        optimizer.state = self.state
        optimizer.param_groups = self.param_groups

    def change(self, optimizer: torch.optim.Optimizer) -> Optional[str]:
        """What differs in ``optimizer``'s containers from the capture (by identity), or None."""
        state = optimizer.state
        if state is not self.state or len(state) != len(self.state_entries):
            return "its state changed"
        for key, value, entries in self.state_entries:
            current = state.get(key)
            if current is not value or current.keys() != entries.keys():
                return "its state changed"
            if any(current[name] is not held for name, held in entries.items()):
                return "its state changed"
        return "its param groups changed" if self.groups_changed(optimizer) else None

    def groups_changed(
        self, optimizer: torch.optim.Optimizer, ignoring: FrozenSet[str] = frozenset()
    ) -> bool:
        """Whether ``optimizer``'s param groups differ from the capture: other group objects,
        keys, hyper-parameter objects or parameters (a new list of the same parameters is no
        change); the keys in ``ignoring`` may appear, change or go."""
        groups = optimizer.param_groups
        if len(groups) != len(self.param_groups):
            return True
        for group, captured, entries, params in zip(
            groups, self.param_groups, self.param_group_entries, self.param_lists
        ):
            if group is not captured or set(group) - ignoring != set(entries) - ignoring:
                return True
            skipped = ignoring | {"params"}
            if any(group[key] is not value for key, value in entries.items() if key not in skipped):
                return True
            if len(group["params"]) != len(params) or any(
                a is not b for a, b in zip(group["params"], params)
            ):
                return True
        return False


def _copy_containers(state_dict: Mapping[str, Any]) -> Dict[str, Any]:
    """Copy the dicts and lists of an optimizer state dict; tensors stay shared."""
    copied = dict(state_dict)
    copied["state"] = {key: dict(value) for key, value in state_dict["state"].items()}
    copied["param_groups"] = [
        {**group, "params": list(group["params"])} for group in state_dict["param_groups"]
    ]
    return copied


def _ask(
    registration: StateAdopterRegistration,
    check: Any,
    context: Union[StateAdoptionContext, StateExportContext],
    disabled: FrozenSet[str],
) -> Optional[str]:
    """Run an adopter's check; one that raises or answers nonsense counts as a decline."""
    if registration.name in disabled:
        return f"disabled by {_DISABLED_ADOPTERS_ENV_VAR}"
    try:
        reason = check(context)
    except Exception as error:
        logger.warning(
            "Optimizer state adopter %r raised in its check and is skipped: %s: %s",
            registration.name,
            type(error).__name__,
            error,
        )
        return f"check raised {type(error).__name__}: {error}"
    if reason is None or isinstance(reason, str):
        return reason
    logger.warning(
        "Optimizer state adopter %r returned %r from its check instead of None or a reason; "
        "treating it as a decline",
        registration.name,
        reason,
    )
    return f"check returned {type(reason).__name__} instead of None or a reason"


def _size(count: int) -> str:
    """Bytes for people: ``1,856 B`` or ``17,014.0 MiB``."""
    return f"{count:,} B" if count < 2**20 else f"{count / 2**20:,.1f} MiB"


def _finish(registry: StateAdopterRegistry, outcome: StateAdoptionOutcome) -> StateAdoptionOutcome:
    """Log ``outcome`` for people (rank 0) and hand it to the outcome hooks (every rank)."""
    for name, reason in outcome.declines:
        log_single_rank(
            logger, logging.DEBUG, "Optimizer state adopter %r declined: %s", name, reason
        )
    sizes = (
        f"{_size(outcome.reused_bytes)} by reference, {_size(outcome.allocated_bytes)} newly "
        "allocated"
    )
    verb = _VERBS[outcome.hook_point]
    if outcome.error is not None:
        log_single_rank(
            logger,
            logging.WARNING,
            "%s raised for %s: %s",
            outcome.method or "An optimizer state adopter",
            outcome.optimizer,
            outcome.error,
        )
    elif outcome.adopter is not None:
        log_single_rank(
            logger,
            logging.INFO,
            "Optimizer state adopter %r %s the state of %s: %s",
            outcome.adopter,
            verb,
            outcome.optimizer,
            sizes,
        )
        if outcome.allocated_bytes > 0 and outcome.hook_point in (_LOAD, _EXPORT):
            log_single_rank(
                logger,
                logging.WARNING,
                "Optimizer state adopter %r %s %s of newly allocated state for %s instead of "
                "the tensors it was given (did PyTorch's loader copy them?)",
                outcome.adopter,
                verb,
                _size(outcome.allocated_bytes),
                outcome.optimizer,
            )
    else:
        log_single_rank(
            logger,
            logging.INFO if outcome.hook_point == _LOAD else logging.DEBUG,
            "%s %s the state of %s (%s): %s",
            outcome.method,
            verb,
            outcome.optimizer,
            outcome.fallback_reason,
            sizes,
        )
    registry.report_outcome(outcome)
    return outcome


def _own_method_label(optimizer: torch.optim.Optimizer, hook_point: str) -> str:
    """The method upstream's call resolves to, e.g. ``FusedAdam.load_state_dict``."""
    method = _METHODS[hook_point]
    if method in getattr(optimizer, "__dict__", {}):
        return f"{method} set on the {type(optimizer).__name__} instance"
    return f"{type(optimizer).__name__}.{method}"


def _run_own_method(
    registry: StateAdopterRegistry,
    optimizer: torch.optim.Optimizer,
    hook_point: str,
    method: str,
    run: Callable[[], Tuple[Any, Any]],
    existing: _Existing,
    declines: List[Tuple[str, str]],
    reason: str,
) -> Tuple[StateAdoptionOutcome, Any]:
    """Run the own code exactly as upstream (``run`` returns its result and the state it left);
    the outcome records it, named ``method``, or its error."""
    outcome = StateAdoptionOutcome(
        hook_point,
        _describe(optimizer),
        None,
        method=method,
        declines=tuple(declines),
        fallback_reason=reason,
    )
    try:
        result, state = run()
    except BaseException as error:  # recorded, then re-raised unchanged
        _finish(registry, replace(outcome, error=f"{type(error).__name__}: {error}"))
        raise
    reused, allocated = _measure(state, existing)
    return (
        _finish(registry, replace(outcome, reused_bytes=reused, allocated_bytes=allocated)),
        result,
    )


def _adopter_outcome(
    registry: StateAdopterRegistry,
    hook_point: str,
    optimizer: torch.optim.Optimizer,
    registration: StateAdopterRegistration,
    state: Any,
    existing: _Existing,
    declines: List[Tuple[str, str]],
) -> StateAdoptionOutcome:
    """The finished outcome of an adopter that handled the call, ``state`` measured."""
    reused, allocated = _measure(state, existing)
    outcome = StateAdoptionOutcome(
        hook_point,
        _describe(optimizer),
        registration.name,
        reused_bytes=reused,
        allocated_bytes=allocated,
        declines=tuple(declines),
    )
    return _finish(registry, outcome)


_Check = Callable[[Any], Optional[str]]


def _load_check(adopter: Any) -> Optional[_Check]:
    """Every adopter's check for the load."""
    check: _Check = adopter.decline_reason
    return check


def _export_check(adopter: Any) -> Optional[_Check]:
    """An exporter's check for the state-dict read; None for an adopter that is no exporter."""
    return adopter.export_decline_reason if isinstance(adopter, StateExporter) else None


def _initialize_check(adopter: Any) -> Optional[_Check]:
    """An initializer's check for the state creation; None for one that is no initializer."""
    return adopter.initialize_decline_reason if isinstance(adopter, StateInitializer) else None


def _no_preparation() -> Tuple[Any, Optional[str]]:
    """What :func:`_first_accepting` prepares by default: nothing, with no objection."""
    return None, None


def _first_accepting(
    registry: StateAdopterRegistry,
    context: Union[StateAdoptionContext, StateExportContext],
    check_of: Callable[[Any], Optional[_Check]],
    declines: List[Tuple[str, str]],
    prepare: Callable[[], Tuple[Any, Optional[str]]] = _no_preparation,
) -> Tuple[Optional[StateAdopterRegistration], Any]:
    """The first registration whose check accepts ``context``, and what ``prepare`` made for it.

    ``check_of(adopter)`` is the adopter's check for this hook point, or None if it has no such
    role (it is then skipped without a decline). ``prepare()`` runs after each acceptance and
    returns (what it made, None) or (None, why the accepting adopter is declined after all).
    Every decline is appended to ``declines``; the adopters after the first that accepts are
    not asked.

    Returns:
        (the accepting registration and what ``prepare`` made, or (None, None)).
    """
    registrations = registry.registrations()
    disabled = _disabled_adopter_names(registrations)
    for registration in registrations:
        check = check_of(registration.adopter)
        if check is None:
            continue
        decline = _ask(registration, check, context, disabled)
        if decline is None:
            prepared, decline = prepare()
            if decline is None:
                return registration, prepared
        declines.append((registration.name, decline))
    return None, None


@dataclass
class _Attempt:
    """What :func:`_undone_if_it_fails` yields: the snapshot taken, and the error, if any."""

    snapshot: "_OptimizerSnapshot"
    error: Optional[Exception] = None


@contextmanager
def _undone_if_it_fails(optimizer: torch.optim.Optimizer) -> Iterator[_Attempt]:
    """Run the block on ``optimizer``; if it raises, restore the optimizer's containers.

    An ``Exception`` is kept in the attempt (the caller falls back to the own code); anything
    else (``KeyboardInterrupt``, ``SystemExit``) is re-raised after the restore.
    """
    attempt = _Attempt(_OptimizerSnapshot.capture(optimizer))
    try:
        yield attempt
    except Exception as error:
        attempt.snapshot.restore(optimizer)
        attempt.error = error
    except BaseException:
        attempt.snapshot.restore(optimizer)
        raise


def _install(
    registration: StateAdopterRegistration,
    context: StateAdoptionContext,
    pristine: Mapping[str, Any],
) -> Optional[str]:
    """Let the adopter install the state and check it against ``pristine`` (the state dict's
    containers as they were before the call); on any failure roll back and say why."""
    with _undone_if_it_fails(context.optimizer) as attempt:
        registration.adopter.adopt(context)
        params = attempt.snapshot.param_lists
        problem = installed_state_decline_reason(context.optimizer, pristine, params)
        if problem is not None:
            raise RuntimeError(f"the installed state does not match the state dict: {problem}")
    if attempt.error is None:
        return None
    # Rolling back is safer than raising: the adopter was only offered a load the own loader
    # can do, no hook has run (optimizers with load hooks never reach an adopter), and the
    # containers are restored exactly, so the own loader then does what upstream does.
    # Raising would fail a resume that upstream completes.
    logger.warning(
        "Optimizer state adopter %r failed while installing the state (%s: %s); the "
        "optimizer was restored and %s.load_state_dict loads the state instead",
        registration.name,
        type(attempt.error).__name__,
        attempt.error,
        type(context.optimizer).__name__,
    )
    return f"adopter {registration.name!r} failed while installing the state"


def _export(
    registration: StateAdopterRegistration, exporter: StateExporter, context: StateExportContext
) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """Let the exporter supply the state dict and check it; on any failure say why."""
    optimizer = context.optimizer
    exported: Any = None
    with _undone_if_it_fails(optimizer) as attempt:
        exported = exporter.export_state_dict(context)
        problem = attempt.snapshot.change(optimizer)
        if problem is not None:
            raise RuntimeError(f"exporting changed the optimizer: {problem}")
        problem = exported_state_dict_decline_reason(optimizer, exported)
        if problem is not None:
            raise ValueError(f"the exported state dict does not match the optimizer: {problem}")
    if attempt.error is None:
        return exported, None
    # Falling back is safer than raising for the same reasons as in _install; an exporter must
    # change nothing, and the restore undoes one that did.
    logger.warning(
        "Optimizer state adopter %r failed to export the state (%s: %s); %s.state_dict is "
        "used instead",
        registration.name,
        type(attempt.error).__name__,
        attempt.error,
        type(optimizer).__name__,
    )
    return None, f"adopter {registration.name!r} failed to export the state"


@contextmanager
def _outcome_if_interrupted(
    registry: StateAdopterRegistry,
    hook_point: str,
    optimizer: torch.optim.Optimizer,
    declines: List[Tuple[str, str]],
) -> Iterator[None]:
    """End the call in an outcome also when consulting the adopters is interrupted.

    Adopters' exceptions are declines or rollbacks; what escapes is a ``KeyboardInterrupt``,
    ``SystemExit`` or the like (the optimizer already restored), recorded and re-raised.
    """
    try:
        yield
    except BaseException as error:
        _finish(
            registry,
            StateAdoptionOutcome(
                hook_point,
                _describe(optimizer),
                None,
                declines=tuple(declines),
                fallback_reason="interrupted while consulting the adopters",
                error=f"{type(error).__name__}: {error}",
            ),
        )
        raise


def _adopted(
    registry: StateAdopterRegistry,
    owner: Any,
    state_dict: Dict[str, Any],
    existing: _Existing,
    declines: List[Tuple[str, str]],
) -> Tuple[Optional[StateAdoptionOutcome], str, Dict[str, Any]]:
    """Offer the load to the adopters in order; the first that accepts installs the state.

    Returns:
        (the outcome, if an adopter installed the state; else why not, and the state dict the
        own loader gets: the caller's, or after a failed install a copy of its containers).
    """
    optimizer = owner.optimizer
    context = StateAdoptionContext.for_owner(owner, state_dict=state_dict)

    def copy_for_a_rollback() -> Tuple[Any, Optional[str]]:
        try:
            return _copy_containers(state_dict), None
        except Exception as error:  # malformed input: the own loader reports it
            return None, f"the state dict cannot be copied for a rollback: {error!r}"

    registration, pristine = _first_accepting(
        registry, context, _load_check, declines, copy_for_a_rollback
    )
    if registration is None:
        why = "every adopter declined" if declines else "no adopter is registered"
        return None, why, state_dict
    failure = _install(registration, context, pristine)
    if failure is not None:
        return None, failure, pristine
    outcome = _adopter_outcome(
        registry, _LOAD, optimizer, registration, optimizer.state, existing, declines
    )
    return outcome, "", state_dict


def _exported_by_adopter(
    registry: StateAdopterRegistry, owner: Any, existing: _Existing, declines: List[Tuple[str, str]]
) -> Tuple[Optional[Dict[str, Any]], str]:
    """Offer the export to the exporters in order; the first that accepts supplies it.

    Returns:
        (the checked export, if an exporter supplied one; else why not).
    """
    context = StateExportContext.for_owner(owner)
    registration, _ = _first_accepting(registry, context, _export_check, declines)
    if registration is None:
        if declines:
            return None, "every state exporter declined"
        return None, "no registered adopter is a state exporter"
    exporter = cast(StateExporter, registration.adopter)
    exported, failure = _export(registration, exporter, context)
    if exported is None:
        assert failure is not None
        return None, failure
    state = exported["state"]
    _adopter_outcome(registry, _EXPORT, owner.optimizer, registration, state, existing, declines)
    return exported, ""


def load_inner_optimizer_state_dict(
    owner: Any, state_dict: Dict[str, Any], registry: Optional[StateAdopterRegistry] = None
) -> StateAdoptionOutcome:
    """Load ``state_dict`` into ``owner.optimizer`` through the first accepting adopter.

    Args:
        owner (Any): the Megatron optimizer whose inner optimizer is loaded (a
            ``DistributedOptimizer``, ``Float16OptimizerWithFloat16Params`` or
            ``FP32Optimizer``).
        state_dict (Dict[str, Any]): the assembled ``{"state", "param_groups"}`` dict.
        registry (StateAdopterRegistry, optional): the adopters to consult; defaults to the
            process-wide registry.

    Returns:
        StateAdoptionOutcome: which adopter installed the state, or which own method did and
        why (also handed to the outcome hooks).
    """
    registry = default_registry() if registry is None else registry
    optimizer = owner.optimizer
    incoming = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    existing = _existing_storages(incoming, optimizer.state)
    declines: List[Tuple[str, str]] = []
    reason = _own_method_reason(owner, optimizer, _LOAD)
    if reason is None:
        with _outcome_if_interrupted(registry, _LOAD, optimizer, declines):
            outcome, reason, state_dict = _adopted(registry, owner, state_dict, existing, declines)
        if outcome is not None:
            return outcome

    def run() -> Tuple[Any, Any]:
        optimizer.load_state_dict(state_dict)
        return None, optimizer.state

    method = _own_method_label(optimizer, _LOAD)
    outcome, _ = _run_own_method(
        registry, optimizer, _LOAD, method, run, existing, declines, reason
    )
    return outcome


def export_inner_optimizer_state_dict(
    owner: Any, registry: Optional[StateAdopterRegistry] = None
) -> Dict[str, Any]:
    """Return ``owner.optimizer``'s state dict, from the first accepting exporter.

    Args:
        owner (Any): the ``DistributedOptimizer`` whose inner optimizer's state dict is read.
        registry (StateAdopterRegistry, optional): the adopters to consult; defaults to the
            process-wide registry.

    Returns:
        Dict[str, Any]: the exporter's state dict (checked against the held state), or
        ``owner.optimizer.state_dict()``.
    """
    registry = default_registry() if registry is None else registry
    optimizer = owner.optimizer
    existing = _existing_storages(optimizer.state)
    declines: List[Tuple[str, str]] = []
    reason = _own_method_reason(owner, optimizer, _EXPORT)
    if reason is None:
        with _outcome_if_interrupted(registry, _EXPORT, optimizer, declines):
            exported, reason = _exported_by_adopter(registry, owner, existing, declines)
        if exported is not None:
            return exported

    def run() -> Tuple[Any, Any]:
        state_dict = optimizer.state_dict()
        return state_dict, state_dict.get("state") if isinstance(state_dict, Mapping) else None

    method = _own_method_label(optimizer, _EXPORT)
    _, own = _run_own_method(registry, optimizer, _EXPORT, method, run, existing, declines, reason)
    own_state_dict: Dict[str, Any] = own
    return own_state_dict


# --- the initialize hook point (Megatron-FSDP) ------------------------------------------------

_GLOBAL_STEP_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


def _own_initialization_reason(owner: Any, optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why the own initialisation must run without consulting initializers, or None.

    Hook registries that cannot be inspected count as registered hooks.
    """
    reason = _switched_off_reason(getattr(owner, "config", None))
    if reason is not None:
        return reason
    if len(optimizer.state) > 0:
        return "the inner optimizer already holds state, which the own initialisation steps"
    if "step" in getattr(optimizer, "__dict__", {}):
        return (
            f"the {type(optimizer).__name__} instance has its own step (set on the instance, "
            "e.g. by a wrapper), which the own initialisation calls"
        )
    for kind in ("pre", "post"):
        hooks = getattr(optimizer, f"_optimizer_step_{kind}_hooks", None)
        if not isinstance(hooks, Mapping):
            return f"the optimizer's step {kind}-hooks cannot be inspected"
        if len(hooks) > 0:
            return f"a step {kind}-hook is registered, which the own initialisation runs"
    for name in _GLOBAL_STEP_HOOKS:
        hooks = getattr(torch_optimizer_module, name, None)
        if not isinstance(hooks, Mapping) or len(hooks) > 0:
            return (
                "global optimizer step hooks are registered (or cannot be inspected), which the "
                "own initialisation runs"
            )
    return None


def _initialized_state_problem(
    optimizer: torch.optim.Optimizer, snapshot: _OptimizerSnapshot
) -> Optional[str]:
    """What an initializer got wrong that every initialisation gets right, or None.

    The param groups are the captured ones with their parameters and hyper-parameters, except
    ``step``, which an optimizer's first step may create or advance (TE keeps its counter there,
    and the own initialisation steps too); every parameter whose local shard is not empty has a
    state entry of at least one tensor; nothing else has state.
    """
    if snapshot.groups_changed(optimizer, ignoring=frozenset({"step"})):
        return "the param groups changed"
    params = [param for group in snapshot.param_lists for param in group]
    known = {id(param) for param in params}
    if any(not isinstance(key, torch.Tensor) or id(key) not in known for key in optimizer.state):
        return "there is state for something that is no parameter of the optimizer"
    for index, param in enumerate(params):
        entry = optimizer.state.get(param)
        if _local(param).numel() == 0:
            continue
        if not isinstance(entry, Mapping) or not any(
            isinstance(value, torch.Tensor) for value in entry.values()
        ):
            return f"parameter {index} has no state"
    return None


def _initialize(
    registration: StateAdopterRegistration,
    initializer: StateInitializer,
    context: StateExportContext,
) -> Optional[str]:
    """Let the initializer create the state and check it; on any failure roll back and say why."""
    optimizer = context.optimizer
    with _undone_if_it_fails(optimizer) as attempt:
        initializer.initialize_state(context)
        problem = _initialized_state_problem(optimizer, attempt.snapshot)
        if problem is not None:
            raise RuntimeError(f"the initialized state is incomplete: {problem}")
    if attempt.error is None:
        return None
    # As in _install: restored, the own initialisation then does what upstream does.
    logger.warning(
        "Optimizer state adopter %r failed to initialize the state (%s: %s); the optimizer "
        "was restored and the own initialisation runs instead",
        registration.name,
        type(attempt.error).__name__,
        attempt.error,
    )
    return f"adopter {registration.name!r} failed to initialize the state"


def _initialized_by_adopter(
    registry: StateAdopterRegistry, owner: Any, existing: _Existing, declines: List[Tuple[str, str]]
) -> Tuple[Optional[StateAdoptionOutcome], str]:
    """Offer the initialisation to the initializers in order; the first that accepts creates it."""
    optimizer = owner.optimizer
    context = StateExportContext.for_owner(owner)
    registration, _ = _first_accepting(registry, context, _initialize_check, declines)
    if registration is None:
        if declines:
            return None, "every state initializer declined"
        return None, "no registered adopter is a state initializer"
    initializer = cast(StateInitializer, registration.adopter)
    failure = _initialize(registration, initializer, context)
    if failure is not None:
        return None, failure
    outcome = _adopter_outcome(
        registry, _INITIALIZE, optimizer, registration, optimizer.state, existing, declines
    )
    return outcome, ""


def initialize_inner_optimizer_state(
    owner: Any,
    own_initialization: Callable[[], None],
    registry: Optional[StateAdopterRegistry] = None,
) -> StateAdoptionOutcome:
    """Create ``owner.optimizer``'s state for loading, by the first accepting initializer.

    Args:
        owner (Any): the Megatron-FSDP ``DistributedOptimizer`` whose inner optimizer's state is
            created.
        own_initialization (Callable[[], None]): what the owner does without this module (its
            dummy step on zero gradients); runs whenever no initializer does.
        registry (StateAdopterRegistry, optional): the adopters to consult; defaults to the
            process-wide registry.

    Returns:
        StateAdoptionOutcome: which initializer created the state, or that the own
        initialisation did and why (also handed to the outcome hooks).
    """
    registry = default_registry() if registry is None else registry
    optimizer = owner.optimizer
    existing = _existing_storages(optimizer.state)
    declines: List[Tuple[str, str]] = []
    reason = _own_initialization_reason(owner, optimizer)
    if reason is None:
        with _outcome_if_interrupted(registry, _INITIALIZE, optimizer, declines):
            outcome, reason = _initialized_by_adopter(registry, owner, existing, declines)
        if outcome is not None:
            return outcome

    def run() -> Tuple[Any, Any]:
        own_initialization()
        return None, optimizer.state

    method = getattr(own_initialization, "__qualname__", repr(own_initialization))
    outcome, _ = _run_own_method(
        registry, optimizer, _INITIALIZE, method, run, existing, declines, reason
    )
    return outcome


# --- the read hook point (precision-aware dp_reshardable loads) -------------------------------

_SCALED_STATE_METHODS = ("get_unscaled_state", "set_scaled_state")
_PLAIN_CAST_DTYPES = frozenset((torch.bfloat16, torch.float32, torch.int16))


def _own_read_reason(owner: Any, optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why upstream's read targets must be used without consulting providers, or None."""
    reason = _switched_off_reason(getattr(owner, "config", None))
    if reason is not None:
        return reason
    for method in _SCALED_STATE_METHODS:
        reason = _instance_method_reason(optimizer, method)
        if reason is not None:
            return reason
    return None


def _read_target_check(adopter: Any) -> Optional[_Check]:
    """A provider's check for the read targets; None for an adopter that is no provider."""
    if isinstance(adopter, StateReadTargetProvider):
        return adopter.read_target_decline_reason
    return None


def _held_local(optimizer: Any, param: torch.Tensor, name: str) -> Optional[torch.Tensor]:
    """The local shard of the state ``name`` that ``optimizer`` holds for ``param``, or None."""
    entry = optimizer.state.get(param)
    held = entry.get(name) if isinstance(entry, Mapping) else None
    return _local(held) if isinstance(held, torch.Tensor) else None


def _is_same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (e.g. a view of all)."""
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def _read_target_problem(
    optimizer: Any, param: torch.Tensor, name: str, target: Any
) -> Optional[str]:
    """Why a provider's read target breaks the contract, or None."""
    if type(target) is not torch.Tensor:
        return f"it returned a {type(target).__name__}, not a plain tensor"
    held = _held_local(optimizer, param, name)
    if held is None:
        return f"the optimizer holds no {name!r} for this parameter"
    if _is_same_tensor(target, held):
        if held.dtype not in _PLAIN_CAST_DTYPES:
            return f"the held {name!r} is {held.dtype}, which TE scales: it needs an FP32 target"
        return None
    if target.dtype != torch.float32 or target.shape != held.shape:
        return f"the target is {target.dtype} {tuple(target.shape)}: neither the held tensor nor FP32 of its shape"
    if target.device != held.device:
        return f"the target is on {target.device}, the held {name!r} on {held.device}"
    storage = _storage(target)
    if storage is not None and storage == _storage(held):
        return "the target overlaps the held tensor without being it"
    return None


class _Read:
    """The read targets of one sharded state dict being built for loading.

    The providers are consulted at the first state tensor asked for, so an owner whose sharded
    state dict asks for none (not precision-aware: its state tensors are read into directly)
    consults nobody and ends in no outcome.
    """

    def __init__(self, owner: Any, registry: StateAdopterRegistry) -> None:
        self.owner = owner
        self.registry = registry
        self.context = StateExportContext.for_owner(owner)
        self.consulted = False
        self.registration: Optional[StateAdopterRegistration] = None
        self.existing: _Existing  # the held state when consulted
        self.declines: List[Tuple[str, str]] = []
        self.reason: Optional[str]  # why upstream's targets, when consulted
        self.failure: Optional[str] = None
        self.targets: List[torch.Tensor] = []

    def _consult(self) -> None:
        """Ask the providers once; remember the accepting one, or why there is none (an
        interrupted consult ends in its own outcome and leaves the read unconsulted)."""
        optimizer = self.owner.optimizer
        self.existing = _existing_storages(optimizer.state)
        reason = _own_read_reason(self.owner, optimizer)
        if reason is None:
            with _outcome_if_interrupted(self.registry, _READ, optimizer, self.declines):
                self.registration, _ = _first_accepting(
                    self.registry, self.context, _read_target_check, self.declines
                )
            if self.registration is None:
                reason = (
                    "every read-target provider declined"
                    if self.declines
                    else ("no registered adopter is a read-target provider")
                )
        self.reason = reason
        self.consulted = True

    def target(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """The accepting provider's target, or upstream's ``get_unscaled_state`` copy."""
        if not self.consulted:
            self._consult()
        optimizer = self.owner.optimizer
        target: torch.Tensor
        if self.registration is not None and self.failure is None:
            provider = cast(StateReadTargetProvider, self.registration.adopter)
            try:
                target = provider.read_target(self.context, param, name)
                problem = _read_target_problem(optimizer, param, name, target)
                if problem is not None:
                    raise ValueError(problem)
            except Exception as error:
                # As in _install: nothing is read yet, and upstream's targets are always right.
                self.failure = (
                    f"adopter {self.registration.name!r} failed to supply the read target of "
                    f"{name!r} of a parameter of shape {tuple(param.shape)} "
                    f"({type(error).__name__}: {error}); it and the rest are get_unscaled_state's"
                )
                logger.warning("Optimizer state %s", self.failure)
            else:
                self.targets.append(target)
                return target
        target = optimizer.get_unscaled_state(param, name)
        self.targets.append(target)
        return target

    def finish(self, error: Optional[BaseException]) -> None:
        """End a consulted read in its outcome: the targets measured, held tensors as reused."""
        if not self.consulted:
            return
        reused, allocated = _measure_tensors(self.targets, self.existing)
        adopter = self.registration.name if self.registration is not None else None
        own = f"{type(self.owner.optimizer).__name__}.get_unscaled_state"
        outcome = StateAdoptionOutcome(
            _READ,
            _describe(self.owner.optimizer),
            adopter,
            method="building the sharded state dict" if error else None if adopter else own,
            reused_bytes=0 if error else reused,
            allocated_bytes=0 if error else allocated,
            declines=tuple(self.declines),
            fallback_reason=self.failure if adopter else self.reason,
            error=f"{type(error).__name__}: {error}" if error is not None else None,
        )
        _finish(self.registry, outcome)


_reads: Dict[int, _Read] = {}


@contextmanager
def reading_optimizer_state(
    owner: Any, is_loading: bool, registry: Optional[StateAdopterRegistry] = None
) -> Iterator[None]:
    """Within the block, ``owner``'s read targets come from the first accepting provider.

    Around the construction of a precision-aware ``DistributedOptimizer``'s sharded state dict
    for loading, the providers are consulted once, at the first state tensor
    :func:`unscaled_state_or_read_target` is asked for, which then hands out the accepting
    provider's targets; the block ends in one outcome. Outside the block, or when
    ``is_loading`` is False (a save, which must write FP32), nothing changes.

    Args:
        owner (Any): the ``DistributedOptimizer`` building its sharded state dict.
        is_loading (bool): whether the sharded state dict is built to load a checkpoint.
        registry (StateAdopterRegistry, optional): the adopters to consult; defaults to the
            process-wide registry.
    """
    if not is_loading or id(owner) in _reads:
        yield
        return
    read = _Read(owner, default_registry() if registry is None else registry)
    _reads[id(owner)] = read
    try:
        yield
    except BaseException as error:
        read.finish(error)
        raise
    finally:
        del _reads[id(owner)]
    read.finish(None)


def unscaled_state_or_read_target(owner: Any, param: torch.Tensor, name: str) -> torch.Tensor:
    """``owner.optimizer.get_unscaled_state(param, name)``, or the tensor to read it into.

    Args:
        owner (Any): the precision-aware ``DistributedOptimizer``.
        param (torch.Tensor): the inner optimizer's parameter.
        name (str): the state's name.

    Returns:
        torch.Tensor: inside :func:`reading_optimizer_state` for ``owner``, the accepting
        provider's read target; otherwise (and after a provider failed) upstream's tensor.
    """
    read = _reads.get(id(owner))
    if read is None or read.owner is not owner:
        unscaled: torch.Tensor = owner.optimizer.get_unscaled_state(param, name)
        return unscaled
    return read.target(param, name)


def store_read_optimizer_state(
    owner: Any, param: torch.Tensor, name: str, tensor: torch.Tensor
) -> None:
    """Store loaded values of state ``name`` of ``param`` as ``set_scaled_state`` would.

    A tensor that is the held tensor was read in place: it stays as it is (upstream's
    ``set_scaled_state`` would copy it onto itself). A BF16 tensor for a BF16 state is a read
    target holding TE's cast already (the held tensor was replaced after the read): it is copied
    in. Everything else -- upstream's FP32 copies, int16 remainders -- goes to
    ``set_scaled_state``.

    Args:
        owner (Any): the precision-aware ``DistributedOptimizer``.
        param (torch.Tensor): the inner optimizer's parameter.
        name (str): the state's name.
        tensor (torch.Tensor): the loaded values.
    """
    optimizer = owner.optimizer
    held = _held_local(optimizer, param, name)
    if held is not None and _is_same_tensor(held, tensor):
        return
    if (
        held is not None
        and held.dtype == tensor.dtype == torch.bfloat16
        and held.shape == tensor.shape
    ):
        held.copy_(tensor)
        return
    optimizer.set_scaled_state(param, name, tensor)
