"""Reproduces on commit d11a15e the holes that issue #18 names; each new CPU test that closes one
was checked against this.

The script targets the *previous* state-adoption subsystem (commit d11a15e), built into a
wheel and installed into a separate directory, and uses that code's API only, private names
included. It runs on CPU with real torch optimizers, TE FusedAdam replaced by the test
stand-in of that commit. Prepare the previous code and run it as::

    mkdir -p /tmp/prev && git -C <repo> archive d11a15e | tar -x -C /tmp/prev
    cd /tmp/prev && MCORE_UPSTREAM_WHEEL=<repo>/build/upstream/megatron_core-0.19.2-<tags>.whl \\
        <repo>/.venv/bin/python -m pip wheel --no-deps --no-build-isolation -w /tmp/prev-dist .
    <repo>/.venv/bin/python -m pip install --no-deps --target /tmp/prev-site /tmp/prev-dist/*.whl
    cd <repo> && \\
    PYTHONPATH=/tmp/prev-site:/tmp/prev/tests .venv/bin/python -P scripts/probe_previous_holes.py

where /tmp/prev-site holds the installed d11a15e wheel and /tmp/prev/tests that commit's
tests (``builders.py``, ``fused_adam_standin.py``). For every hole it prints one line,
``hole N: REPRODUCED: ...`` or ``hole N: not reproduced: ...``, followed by indented details.
It always exits 0.
"""

import contextlib
import dataclasses
import importlib
import logging
import os
import sys
import tempfile
import textwrap
import tomllib
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

warnings.filterwarnings("ignore")  # megatron's import-time "TE/Apex not installed" warnings

import torch  # noqa: E402
from packaging.requirements import Requirement  # noqa: E402

import megatron.core  # noqa: E402
from megatron.core.optimizer.state_adoption import (  # noqa: E402
    StateAdoptionContext,
    StateAdoptionOutcome,
    StateExportContext,
    register_outcome_hook,
    testing,
)
from megatron.core.optimizer.state_adoption.loader import (  # noqa: E402
    _export_inner_state,
    _load_inner_state,
)
from megatron.core.optimizer.state_adoption.registry import (  # noqa: E402
    _ENTRY_POINT_GROUP,
    _StateAdopterRegistry,
)
from megatron.core.optimizer.state_adoption.settings import (  # noqa: E402
    _DISABLE_ENV_VAR,
    _DISABLED_ADOPTERS_ENV_VAR,
)

from builders import (  # noqa: E402  (from the tests of d11a15e)
    Owner,
    cloned_state_dict,
    fresh_standin,
    numel_bytes,
    standin_adopter,
    trained_standin,
)

PREVIOUS_SITE = "/tmp/prev-site"
PREVIOUS_CHECKOUT = Path("/tmp/prev")
STATE_ADOPTION_LOGGER = "megatron.core.optimizer.state_adoption"
TE_ADOPTER_NAME = "te_fused_adam_fp32"
ALL_ENV_VARS = (_DISABLE_ENV_VAR, _DISABLED_ADOPTERS_ENV_VAR, _DISABLE_ENV_VAR + "S")


@dataclasses.dataclass
class Finding:
    """What probing one hole showed."""

    reproduced: bool
    summary: str
    details: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Part:
    """One claim of a hole with several claims: a short label, whether it held, what showed."""

    label: str
    reproduced: bool
    detail: str


def parts_finding(parts: List[Part], claim: str) -> Finding:
    """Reproduced if any part is; the summary counts the parts and names those that failed."""
    count = sum(part.reproduced for part in parts)
    summary = f"{count} of {len(parts)} parts: {claim}"
    failed = [part.label for part in parts if not part.reproduced]
    if failed:
        summary += f"; not reproduced: {', '.join(failed)}"
    details = [
        f"[{'reproduced' if part.reproduced else 'NOT reproduced'}] {part.label}: {part.detail}"
        for part in parts
    ]
    return Finding(count > 0, summary, details)


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set exactly ``values`` among the adoption variables; restore everything afterwards."""
    saved = {name: os.environ.get(name) for name in set(ALL_ENV_VARS) | set(values)}
    for name in saved:
        os.environ.pop(name, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def captured_logs() -> Iterator[List[logging.LogRecord]]:
    """Collect every record (DEBUG and up) the state-adoption modules log."""
    records: List[logging.LogRecord] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger(STATE_ADOPTION_LOGGER)
    handler, old_level = _Collect(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def levels(records: List[logging.LogRecord], at_least: int = logging.DEBUG) -> List[str]:
    """'LEVEL: message' for every record at or above ``at_least``."""
    return [f"{r.levelname}: {r.getMessage()}" for r in records if r.levelno >= at_least]


@contextlib.contextmanager
def recorded_outcomes() -> Iterator[List[StateAdoptionOutcome]]:
    """Collect the outcomes handed to the outcome hooks while the block runs."""
    outcomes: List[StateAdoptionOutcome] = []
    handle = register_outcome_hook(outcomes.append)
    try:
        yield outcomes
    finally:
        handle.remove()


Shapes = Tuple[Tuple[int, ...], ...]


def trained_adam(shapes: Shapes = ((4,), (4,)), steps: int = 2) -> torch.optim.Adam:
    """A real ``torch.optim.Adam`` that took ``steps`` steps (so its state is populated)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    return optimizer


def fresh_adam(shapes: Shapes = ((4,), (4,))) -> torch.optim.Adam:
    """A ``torch.optim.Adam`` with the same parameter values as :func:`trained_adam`, no state."""
    torch.manual_seed(0)
    return torch.optim.Adam([torch.nn.Parameter(torch.randn(s)) for s in shapes], lr=1e-2)


def isolated_registry(*adopters: Any) -> _StateAdopterRegistry:
    """A registry without entry-point discovery holding ``adopters`` in order."""
    registry = _StateAdopterRegistry(entry_point_group=None)
    for adopter in adopters:
        registry.register(adopter)
    return registry


class TorchLoaderAdopter:
    """Accepts everything and installs with PyTorch's loader (by reference); reports ``avoided``."""

    def __init__(self, name: str = "torch_loader", avoided: int = 0) -> None:
        self.name = name
        self.avoided = avoided

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return None

    def adopt(self, context: StateAdoptionContext) -> int:
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
        return self.avoided


class DecliningAdopter:
    """Declines every load."""

    name = "always_declines"

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return "this probe adopter always declines"

    def adopt(self, context: StateAdoptionContext) -> int:
        raise AssertionError("never called")


def standin_load(registry: _StateAdopterRegistry) -> StateAdoptionOutcome:
    """Load a trained stand-in FusedAdam's cloned state into a fresh one through ``registry``."""
    return _load_inner_state(Owner(fresh_standin()), cloned_state_dict(trained_standin()), registry)


@contextlib.contextmanager
def fake_plugin_distribution(entry_point_name: str, adopter_name: str) -> Iterator[str]:
    """Put a fake installed distribution on ``sys.path`` declaring one adopter entry point.

    The entry point ``entry_point_name`` (group ``megatron_core.optimizer_state_adopters``)
    names ``probe_plugin_module:PluginAdopter``, whose ``name`` is ``adopter_name``.
    Yields the adopter's name.
    """
    with tempfile.TemporaryDirectory(prefix="probe-plugin-") as directory:
        root = Path(directory)
        (root / "probe_plugin_module.py").write_text(
            textwrap.dedent(
                f"""
                import torch

                class PluginAdopter:
                    name = {adopter_name!r}

                    def decline_reason(self, context):
                        return None

                    def adopt(self, context):
                        torch.optim.Optimizer.load_state_dict(
                            context.optimizer, dict(context.state_dict)
                        )
                        return 0
                """
            )
        )
        dist_info = root / "probe_plugin-1.0.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: probe-plugin\nVersion: 1.0\n"
        )
        (dist_info / "entry_points.txt").write_text(
            f"[{_ENTRY_POINT_GROUP}]\n{entry_point_name} = probe_plugin_module:PluginAdopter\n"
        )
        sys.path.insert(0, directory)
        importlib.invalidate_caches()
        try:
            yield adopter_name
        finally:
            sys.path.remove(directory)
            sys.modules.pop("probe_plugin_module", None)
            importlib.invalidate_caches()


# --------------------------------------------------------------------------------------------
# The holes
# --------------------------------------------------------------------------------------------


class MalformedExporter:
    """An exporter whose state dict has the right param groups but ``mangle``d state."""

    def __init__(self, mangle: Callable[[Dict[str, Any]], None]) -> None:
        self.name = "malformed_exporter"
        self._mangle = mangle

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return "only exports"

    def adopt(self, context: StateAdoptionContext) -> int:
        raise AssertionError("never called")

    def export_decline_reason(self, context: StateExportContext) -> Optional[str]:
        return None

    def export_state_dict(self, context: StateExportContext) -> Tuple[Dict[str, Any], int]:
        state_dict = torch.optim.Optimizer.state_dict(context.optimizer)
        self._mangle(state_dict)
        return state_dict, 0


def hole_1_malformed_export_is_trusted() -> Finding:
    """An export with an empty or permuted ``state`` is accepted as a success."""
    details: List[str] = []
    results: List[bool] = []

    def empty(state_dict: Dict[str, Any]) -> None:
        state_dict["state"] = {}

    def permuted(state_dict: Dict[str, Any]) -> None:
        state = state_dict["state"]
        state[0], state[1] = state[1], state[0]

    for label, mangle in (("empty state", empty), ("state of params 0 and 1 swapped", permuted)):
        optimizer = trained_adam()  # two parameters of shape (4,)
        first, second = optimizer.param_groups[0]["params"]
        with recorded_outcomes() as outcomes:
            exported = _export_inner_state(
                Owner(optimizer), isolated_registry(MalformedExporter(mangle))
            )
        outcome = outcomes[-1]
        if label == "empty state":
            bad = exported["state"] == {} and len(optimizer.state) == 2
            shown = f"returned state = {exported['state']!r} (the optimizer holds 2 entries)"
        else:
            bad = (
                exported["state"][0]["exp_avg"] is optimizer.state[second]["exp_avg"]
                and exported["state"][1]["exp_avg"] is optimizer.state[first]["exp_avg"]
            )
            shown = "returned state[0] holds param 1's exp_avg and state[1] param 0's"
        accepted = outcome.adopter == "malformed_exporter" and outcome.fallback_reason is None
        results.append(bad and accepted)
        details.append(
            f"{label}: {shown}; outcome adopter={outcome.adopter!r}, "
            f"fallback_reason={outcome.fallback_reason!r}"
        )
    if all(results):
        return Finding(
            True,
            "_export_inner_state returned an empty state and a permuted state as they were; "
            "both outcomes name 'malformed_exporter' as the successful exporter",
            details,
        )
    return Finding(False, "a malformed export was rejected", details)


class LoadsThenRaises:
    """Runs PyTorch's loader (and so its hooks) on the optimizer, then fails."""

    name = "loads_then_raises"

    def decline_reason(self, context: StateAdoptionContext) -> Optional[str]:
        return None

    def adopt(self, context: StateAdoptionContext) -> int:
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))
        raise RuntimeError("failed after installing")


def hole_2_hooks_run_twice() -> Finding:
    """A failing adopter that ran PyTorch's loader makes its hooks run again on the fallback."""
    details: List[str] = []
    counts: Dict[str, int] = {}
    for kind in ("post", "pre"):
        calls: List[str] = []

        def register(optimizer: torch.optim.Optimizer) -> None:
            if kind == "post":
                optimizer.register_load_state_dict_post_hook(lambda opt: calls.append(kind))
            else:
                optimizer.register_load_state_dict_pre_hook(lambda opt, sd: calls.append(kind))

        upstream = fresh_adam()
        register(upstream)
        upstream.load_state_dict(cloned_state_dict(trained_adam()))
        upstream_count = len(calls)
        calls.clear()

        optimizer = fresh_adam()
        register(optimizer)
        with captured_logs():
            outcome = _load_inner_state(
                Owner(optimizer),
                cloned_state_dict(trained_adam()),
                isolated_registry(LoadsThenRaises()),
            )
        counts[kind] = len(calls)
        details.append(
            f"load_state_dict {kind}-hook: upstream load ran it {upstream_count} time(s); "
            f"_load_inner_state ran it {len(calls)} time(s) "
            f"(outcome adopter={outcome.adopter!r}, fallback_reason={outcome.fallback_reason!r})"
        )
    if counts["post"] == 2 and counts["pre"] == 2:
        return Finding(
            True,
            "after the adopter ran PyTorch's loader and raised, the rollback did not undo the "
            "hooks: the post-hook and the pre-hook each ran 2 times (upstream: once)",
            details,
        )
    return Finding(False, f"hook counts {counts}", details)


def hole_3_no_outcome_when_own_loader_raises() -> Finding:
    """If the optimizer's own loader raises, no outcome reaches the hooks."""
    optimizer = fresh_adam()  # one param group
    state_dict = cloned_state_dict(trained_adam())
    state_dict["param_groups"] = state_dict["param_groups"] * 2  # two groups: own loader raises
    raised: Optional[BaseException] = None
    with recorded_outcomes() as outcomes:
        try:
            _load_inner_state(Owner(optimizer), state_dict, isolated_registry(DecliningAdopter()))
        except Exception as error:  # the point of the probe
            raised = error
    details = [
        f"raised: {type(raised).__name__}: {raised}" if raised else "nothing raised",
        f"outcomes received by the hook: {len(outcomes)}",
    ]
    if raised is not None and not outcomes:
        return Finding(
            True,
            f"the own loader's {type(raised).__name__} propagated and the outcome hook received "
            "nothing (not even the adopter's decline)",
            details,
        )
    return Finding(False, "an outcome was reported or nothing raised", details)


def _switch_part(label: str, variables: Dict[str, str]) -> Part:
    """Load through the stand-in adopter with ``variables`` set: does it install, silently?"""
    with environment(**variables), captured_logs() as records:
        outcome = standin_load(isolated_registry(standin_adopter()))
    warned = levels(records, logging.WARNING)
    return Part(
        label,
        outcome.adopter == TE_ADOPTER_NAME and not warned,
        f"adopter={outcome.adopter!r}, WARNING records={warned or 'none'}",
    )


def _entry_point_name_part() -> Part:
    """Disable an entry-point plugin by its entry-point name, which differs from its ``name``."""
    with fake_plugin_distribution("probe_ep_alias", "probe_plugin_adopter") as adopter_name:
        registry = _StateAdopterRegistry()  # discovers the fake plugin's entry point
        variables = {_DISABLED_ADOPTERS_ENV_VAR: "probe_ep_alias"}
        with environment(**variables), captured_logs() as records:
            outcome = _load_inner_state(
                Owner(fresh_adam()), cloned_state_dict(trained_adam()), registry
            )
        origins = [r.origin for r in registry.registrations() if r.name == adopter_name]
    warned = levels(records, logging.WARNING)
    return Part(
        f"{_DISABLED_ADOPTERS_ENV_VAR}=probe_ep_alias (entry-point name)",
        outcome.adopter == adopter_name and not warned,
        f"plugin registered as {origins}: adopter={outcome.adopter!r}, "
        f"WARNING records={warned or 'none'}",
    )


def _kill_switch_part() -> Part:
    """The working kill switch: does it say so above DEBUG?"""
    with environment(**{_DISABLE_ENV_VAR: "1"}), captured_logs() as records:
        outcome = standin_load(isolated_registry(standin_adopter()))
    above_debug = levels(records, logging.INFO)
    return Part(
        f"{_DISABLE_ENV_VAR}=1 logs only at DEBUG",
        outcome.adopter is None and bool(records) and not above_debug,
        f"adopter={outcome.adopter!r}; records: {levels(records)}; "
        f"at INFO or above: {above_debug or 'none'}",
    )


def _odd_name_part(name: str) -> Part:
    """Register an adopter under ``name``, then try to disable it by that exact name."""
    registry = isolated_registry(TorchLoaderAdopter(name))  # register() accepts it
    with environment(**{_DISABLED_ADOPTERS_ENV_VAR: name}):
        outcome = _load_inner_state(
            Owner(fresh_adam()), cloned_state_dict(trained_adam()), registry
        )
    return Part(
        f"name {name!r} cannot be disabled",
        outcome.adopter == name,
        f"register() accepted {name!r}; with {_DISABLED_ADOPTERS_ENV_VAR}={name!r}: "
        f"adopter={outcome.adopter!r}, declines={list(outcome.declines)}",
    )


def hole_4_silent_switches() -> Finding:
    """Mistyped or unmatched settings are ignored without a word; the working switch is quiet."""
    plural = _DISABLE_ENV_VAR + "S"
    parts = [
        _switch_part(f"{_DISABLE_ENV_VAR}={value}", {_DISABLE_ENV_VAR: value})
        for value in ("ture", "2", "y", "disable")
    ]
    parts.append(
        _switch_part(
            f"{_DISABLED_ADOPTERS_ENV_VAR}=te_fused_adam_fp23",
            {_DISABLED_ADOPTERS_ENV_VAR: "te_fused_adam_fp23"},
        )
    )
    parts.append(_switch_part(f"{plural}=1 (plural typo)", {plural: "1"}))
    parts.append(_entry_point_name_part())
    parts.append(_kill_switch_part())
    parts.extend(_odd_name_part(name) for name in ("my adopter", "a\tb", " padded "))
    return parts_finding(
        parts,
        "mistyped kill-switch values, an unknown adopter name, the plural variable name and "
        "an entry-point name all leave adoption on with no WARNING; the working kill switch "
        "logs only at DEBUG; a name with outer spaces is registered but cannot be disabled",
    )


def hole_5_order_depends_on_timing() -> Finding:
    """A code-registered adopter lands before or after entry-point plugins depending on when."""
    code_adopter = "probe_code_adopter"
    with fake_plugin_distribution("probe_ep_alias", "probe_plugin_adopter") as plugin:
        early = _StateAdopterRegistry()
        early.register(TorchLoaderAdopter(code_adopter))  # before the first listing
        early_order = [r.name for r in early.registrations()]

        late = _StateAdopterRegistry()
        late.registrations()  # the first load or listing discovers the entry points
        late.register(TorchLoaderAdopter(code_adopter))
        late_order = [r.name for r in late.registrations()]
    details = [
        f"registered before the first listing: order {early_order}",
        f"registered after the first listing:  order {late_order}",
    ]
    if early_order.index(code_adopter) < early_order.index(plugin) and late_order.index(
        code_adopter
    ) > late_order.index(plugin):
        return Finding(
            True,
            f"the same register() call puts {code_adopter!r} ahead of the plugin "
            f"{plugin!r} when made before the first load/listing and behind it when made after",
            details,
        )
    return Finding(False, "the order did not depend on timing", details)


def _made_up_figure_part() -> Part:
    """An adopter's invented byte count goes into the outcome unchecked."""
    optimizer = fresh_adam()
    outcome = _load_inner_state(
        Owner(optimizer),
        cloned_state_dict(trained_adam()),
        isolated_registry(TorchLoaderAdopter("boastful", avoided=10**12)),
    )
    total = sum(p.nbytes for g in optimizer.param_groups for p in g["params"])
    return Part(
        "made-up 10**12 reported",
        outcome.avoided_bytes == 10**12,
        f"outcome avoided_bytes={outcome.avoided_bytes} (the parameters total {total} bytes)",
    )


def _two_passes_part() -> Part:
    """Both load passes (scaffold, then the real state) claim the full 8 B/param."""
    optimizer = fresh_standin()
    registry = isolated_registry(standin_adopter())
    passes = [
        _load_inner_state(Owner(optimizer), cloned_state_dict(trained_standin()), registry)
        for _ in range(2)
    ]
    elements = numel_bytes(optimizer, per_element=1)
    per_param = [outcome.avoided_bytes / elements for outcome in passes]
    summed = sum(per_param)
    return Part(
        "two passes sum to 16 B/param",
        per_param == [8.0, 8.0] and summed == 16.0,
        f"two loads into one stand-in: {per_param} B/param each, {summed} B/param summed, "
        "though the passes run one after the other and each avoids a transient of 8 B/param",
    )


def _class_name_only_part() -> Part:
    """Outcomes of two different optimizer instances are indistinguishable."""
    first = standin_load(isolated_registry(standin_adopter()))
    second = standin_load(isolated_registry(standin_adopter()))
    return Part(
        "optimizer field is the class name only",
        first == second and first.optimizer == "FusedAdamStandIn",
        f"two different stand-in instances: outcomes equal={first == second}, "
        f"optimizer={first.optimizer!r}",
    )


def _no_adopter_registered_part() -> Part:
    """An export with a registered, non-exporting adopter claims none is registered."""
    with recorded_outcomes() as outcomes:
        _export_inner_state(Owner(trained_standin()), isolated_registry(standin_adopter()))
    reason = outcomes[-1].fallback_reason
    return Part(
        "export says 'no adopter is registered'",
        reason == "no adopter is registered",
        f"only {TE_ADOPTER_NAME!r} registered (an adopter, not an exporter): "
        f"fallback_reason={reason!r}",
    )


def _by_reference_loader(self: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> None:
    """An instance-level loader (like Megatron-Bridge's) that installs tensors by reference."""
    torch.optim.Optimizer.load_state_dict(self, state_dict)


def _instance_loader_part() -> Part:
    """An instance-level loader that avoids the copy is reported as avoiding nothing."""
    optimizer = fresh_standin()
    optimizer.load_state_dict = types.MethodType(  # type: ignore[method-assign]
        _by_reference_loader, optimizer
    )
    incoming = cloned_state_dict(trained_standin())
    with captured_logs():
        outcome = _load_inner_state(
            Owner(optimizer), incoming, isolated_registry(standin_adopter())
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in incoming["param_groups"] for i in g["params"]]
    by_reference = all(
        optimizer.state[param][key] is incoming["state"][state_id][key]
        for state_id, param in zip(ids, params)
        for key in ("exp_avg", "exp_avg_sq")
    )
    return Part(
        "by-reference instance loader reported as 0 bytes",
        by_reference and outcome.adopter is None and outcome.avoided_bytes == 0,
        f"every installed moment is the incoming tensor: {by_reference} "
        f"({numel_bytes(optimizer)} bytes not copied); outcome adopter={outcome.adopter!r}, "
        f"avoided_bytes={outcome.avoided_bytes}",
    )


def hole_6_saving_figure_is_asserted() -> Finding:
    """``avoided_bytes`` and the outcome fields report what they are told, not what happened."""
    parts = [
        _made_up_figure_part(),
        _two_passes_part(),
        _class_name_only_part(),
        _no_adopter_registered_part(),
        _instance_loader_part(),
    ]
    return parts_finding(
        parts,
        "a made-up 10**12 is reported as avoided; two passes sum to 16 B/param; outcomes name "
        "only the class; an export with a registered non-exporter says 'no adopter is "
        "registered'; a by-reference instance loader is reported as 0 avoided bytes",
    )


def hole_7_pytorch_may_stop_aliasing() -> Finding:
    """The built-in adopter relies on PyTorch's loader keeping the incoming tensors."""
    details = [
        "by inspection: TEFusedAdamFP32StateAdopter.adopt (te_fused_adam.py) runs "
        "torch.optim.Optimizer.load_state_dict and then checks 'installed.get(key) is not "
        "incoming[key]' for both moments; if PyTorch copied, it raises RuntimeError, "
        "loader._install restores the snapshot, logs a WARNING and FusedAdam's own loader runs "
        "(the saving is lost at every load; nothing checks this before a load)",
    ]
    return Finding(
        True,
        "by inspection: the old adopter raises RuntimeError and rolls back when identity fails, "
        "so a torch that copies would silently cost the saving at every load",
        details,
    )


def hole_8_testing_helper_crashes_on_adam() -> Finding:
    """``assert_adoption_matches_own_loader`` fails on torch.optim.Adam's 0-d ``step``."""
    source = trained_adam()
    step = next(iter(source.state.values()))["step"]
    try:
        testing.assert_adoption_matches_own_loader(
            TorchLoaderAdopter(), fresh_adam, lambda: cloned_state_dict(source)
        )
    except Exception as error:  # the point of the probe
        return Finding(
            True,
            f"the helper raised {type(error).__name__}: {error}",
            [f"Adam's state 'step' is a {step.dim()}-d {step.dtype} tensor; "
             "_bitwise_equal calls .view(torch.uint8) on it"],
        )
    return Finding(False, "the helper passed on torch.optim.Adam", [])


def hole_9_example_plugin_resolves_plain_upstream() -> Finding:
    """The example plugin's requirement is met by a plain upstream megatron-core release."""
    pyproject = PREVIOUS_CHECKOUT / "examples/te-precision-aware-adopter/pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    requirement = Requirement(next(d for d in dependencies if d.startswith("megatron-core")))
    satisfied = requirement.specifier.contains("0.19.2")
    details = [f"{pyproject}: dependencies = {dependencies}"]
    if satisfied:
        return Finding(
            True,
            f"{str(requirement)!r} is satisfied by plain '0.19.2' (no +stateadoption), which "
            "has no state-adoption subsystem",
            details,
        )
    return Finding(False, f"{str(requirement)!r} excludes plain 0.19.2", details)


HOLES: List[Callable[[], Finding]] = [
    hole_1_malformed_export_is_trusted,
    hole_2_hooks_run_twice,
    hole_3_no_outcome_when_own_loader_raises,
    hole_4_silent_switches,
    hole_5_order_depends_on_timing,
    hole_6_saving_figure_is_asserted,
    hole_7_pytorch_may_stop_aliasing,
    hole_8_testing_helper_crashes_on_adam,
    hole_9_example_plugin_resolves_plain_upstream,
]


def main() -> int:
    """Probe every hole and print one verdict line each (with details); always return 0."""
    import megatron.core.optimizer.state_adoption as state_adoption

    print(f"megatron.core imported from {megatron.core.__file__}")
    print(f"state_adoption imported from {state_adoption.__file__}")
    if not str(megatron.core.__file__).startswith(PREVIOUS_SITE):
        print(f"WARNING: megatron.core is not from {PREVIOUS_SITE}; results are not for d11a15e")
    print(f"torch {torch.__version__}")
    logging.getLogger(STATE_ADOPTION_LOGGER).addHandler(logging.NullHandler())
    for number, probe in enumerate(HOLES, start=1):
        with environment():
            try:
                finding = probe()
            except Exception as error:  # a probe bug must not hide the other holes
                finding = Finding(False, f"the probe raised {type(error).__name__}: {error}")
        verdict = "REPRODUCED" if finding.reproduced else "not reproduced"
        print(f"hole {number}: {verdict}: {finding.summary}")
        for detail in finding.details:
            print(f"    - {detail}")
    return 0


if __name__ == "__main__":
    main()
    sys.exit(0)
