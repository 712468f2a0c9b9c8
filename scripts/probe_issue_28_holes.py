"""Reproduces on the code before issue #28's redesign (commit 3987781) the holes the issue names;
each has a test in tests/state_adoption/ (test_holes.py, test_registry.py) that passes now.

It uses the previous subsystem's API (its protocols, loader functions and registry), on CPU,
with TE FusedAdam replaced by the repository's stand-in (tests/fused_adam_standin.py). Prepare
the previous code and run it as (docs/holes-issue-28.txt has the output)::

    mkdir -p /tmp/prev && git archive 3987781 | tar -x -C /tmp/prev
    (cd /tmp/prev && MCORE_UPSTREAM_WHEEL=<repo>/build/upstream/megatron_core-0.19.2-<tags>.whl \\
        python -m pip wheel --no-deps --no-build-isolation -w /tmp/prev-dist .)
    python -m pip install --no-deps --target /tmp/prev-site /tmp/prev-dist/*.whl
    PYTHONPATH=/tmp/prev-site:/tmp/prev/tests python -P scripts/probe_issue_28_holes.py

Every hole prints ``hole N: REPRODUCED: ...`` or ``hole N: not reproduced: ...``. Exit status 0.
"""

import dataclasses
import sys
import threading
import types
import warnings
from typing import Any, Callable, Dict, List, Tuple

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from fused_adam_standin import FusedAdamStandIn  # noqa: E402
from mcore_owners import CpuFP32Optimizer  # noqa: E402

import megatron.core.optimizer.state_adoption as old  # noqa: E402
from megatron.core.optimizer.optimizer_config import OptimizerConfig  # noqa: E402
from megatron.core.optimizer.state_adoption.te_fused_adam import (  # noqa: E402
    TEFusedAdamFP32StateAdopter,
)

SHAPES = [(6,), (2, 3), (6,), (5,)]
KEYS = ("exp_avg", "exp_avg_sq", "master_param")


@dataclasses.dataclass
class Owner:
    optimizer: Any
    config: Any = dataclasses.field(default_factory=OptimizerConfig)
    ddp_config: Any = None
    is_stub_optimizer: bool = False


def registry(*adopters: Any) -> Any:
    result = old.StateAdopterRegistry(entry_point_group=None)
    for adopter in adopters:
        result.register(adopter)
    return result


def report(number: str, reproduced: bool, what: str, details: List[str] = ()) -> None:  # type: ignore[assignment]
    print(f"hole {number}: {'REPRODUCED' if reproduced else 'not reproduced'}: {what}")
    for line in details:
        print(f"    - {line}")


# --- holes 1 to 4 and two medium ones: read targets -------------------------------------------


class Provider:
    def __init__(self, target_of: Dict[str, Callable[[Any, torch.Tensor], Any]]) -> None:
        self.name, self.target_of = "provider", target_of

    def decline_reason(self, context: Any) -> str:
        return "reads only"

    def adopt(self, context: Any) -> None:
        raise AssertionError

    def read_target_decline_reason(self, context: Any) -> None:
        return None

    def read_target(self, context: Any, param: torch.Tensor, name: str) -> Any:
        optimizer = context.optimizer
        if name in self.target_of:
            return self.target_of[name](optimizer, param)
        return optimizer.state[param][name] if name != "master_param" else optimizer.get_unscaled_state(param, name)


def precision_aware(dtype: torch.dtype = torch.float32, remainders: bool = False) -> Owner:
    params = [torch.nn.Parameter(torch.full(s, float(i + 1)).to(dtype)) for i, s in enumerate(SHAPES)]
    optimizer = FusedAdamStandIn(
        [{"params": params}], master_weights=True, exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16, store_param_remainders=remainders,
    )  # fmt: skip
    for param in params:
        optimizer.initialize_state(param, store_param_remainders=remainders and dtype == torch.bfloat16)
    return Owner(optimizer)


def resume_read(owner: Owner, target_registry: Any) -> Tuple[List[torch.Tensor], str]:
    """Targets, the read (a cast into each), the store; the state after and the outcome's words."""
    params = owner.optimizer.param_groups[0]["params"]
    outcomes: List[Any] = []
    target_registry.register_outcome_hook(outcomes.append)
    try:
        with old.reading_optimizer_state(owner, True, registry=target_registry):
            targets = {(i, k): old.unscaled_state_or_read_target(owner, p, k) for i, p in enumerate(params) for k in KEYS}
        for (index, key), target in targets.items():
            held = owner.optimizer.state[params[index]][key]
            dtype = torch.int16 if held.dtype == torch.int16 else torch.float32
            target.copy_(torch.full(params[index].shape, 0.25 * (3 * index + KEYS.index(key) + 1)).to(dtype))
        for (index, key), target in targets.items():
            old.store_read_optimizer_state(owner, params[index], key, target)
    except Exception as error:  # noqa: BLE001 - reported
        return [], f"raised {type(error).__name__}: {error}"
    state = [owner.optimizer.state[p][k].clone() for p in params for k in KEYS]
    return state, f"outcome adopter={outcomes[-1].adopter!r}, fallback_reason={outcomes[-1].fallback_reason!r}"


def probe_read_targets() -> None:
    upstream, _ = resume_read(precision_aware(), registry())
    scratch = torch.empty(64)[:6]
    cache: Dict[Any, torch.Tensor] = {}

    def master_of_0_for_2(optimizer: Any, param: torch.Tensor) -> torch.Tensor:
        params = optimizer.param_groups[0]["params"]
        return optimizer.state[params[0] if param is params[2] else param]["master_param"]

    cases = {
        "1": ("one FP32 scratch tensor for both moments", {"exp_avg": lambda o, p: scratch, "exp_avg_sq": lambda o, p: scratch}),
        "2": ("a scratch cached per shape (parameters 0 and 2)", {"exp_avg": lambda o, p: cache.setdefault(tuple(p.shape), torch.empty(p.shape))}),
        "3": ("exp_avg read into the held FP32 master weights", {"exp_avg": lambda o, p: o.state[p]["master_param"]}),
        "4": ("parameter 0's master target given to parameter 2", {"master_param": master_of_0_for_2}),
    }  # fmt: skip
    for number, (what, target_of) in cases.items():
        state, words = resume_read(precision_aware(), registry(Provider(target_of)))
        wrong = bool(state) and any(not torch.equal(a, b) for a, b in zip(state, upstream))
        report(number, wrong, f"{what}: accepted, the state after read and store differs from upstream's", [words])
    upstream, _ = resume_read(precision_aware(torch.bfloat16, True), registry())
    medium = {
        "medium (int16 remainders, FP32 target)": {"master_param": lambda o, p: torch.zeros(p.shape)},
        "medium (stride-0 target)": {"exp_avg": lambda o, p: torch.zeros(1).expand(p.shape)},
    }
    for number, target_of in medium.items():
        state, words = resume_read(precision_aware(torch.bfloat16, True), registry(Provider(target_of)))
        report(number, "accepted" not in words and (not state or words.startswith("outcome adopter='provider', fallback_reason=None")), "accepted by the read-target check", [words])


# --- holes 5 and 6 and a medium one: initializers ---------------------------------------------


class Initializer:
    def __init__(self, make: Callable[[torch.Tensor], Dict[str, torch.Tensor]]) -> None:
        self.name, self.make = "initializer", make

    def decline_reason(self, context: Any) -> str:
        return "initializes only"

    def adopt(self, context: Any) -> None:
        raise AssertionError

    def initialize_decline_reason(self, context: Any) -> None:
        return None

    def initialize_state(self, context: Any) -> None:
        for param in context.optimizer.param_groups[0]["params"]:
            context.optimizer.state[param] = self.make(param)


def probe_initializers() -> None:
    checkpoint = FusedAdamStandIn([{"params": [torch.nn.Parameter(torch.ones(4))]}])
    for _ in range(2):
        checkpoint.param_groups[0]["params"][0].grad = torch.full((4,), 1 / 3)
        checkpoint.step()
    saved = checkpoint.state[checkpoint.param_groups[0]["params"][0]]
    cases = {
        "5": ("omits step", lambda p: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}),
        "6": ("creates BF16 moments", lambda p: {k: torch.zeros_like(p, dtype=torch.bfloat16) for k in ("exp_avg", "exp_avg_sq")}),
        "medium (exp_avg only)": ("creates exp_avg only", lambda p: {"exp_avg": torch.zeros_like(p)}),
    }  # fmt: skip
    for number, (what, make) in cases.items():
        param = torch.nn.Parameter(torch.ones(4))
        owner = Owner(FusedAdamStandIn([{"params": [param]}]))
        outcome = old.initialize_inner_optimizer_state(owner, lambda: None, registry=registry(Initializer(make)))
        held, group = owner.optimizer.state[param], owner.optimizer.param_groups[0]
        for key, value in held.items():
            value.copy_(saved[key])
        group.update({k: checkpoint.param_groups[0][k] for k in group if k != "params"})
        details = [f"initialize outcome adopter={outcome.adopter!r}", f"after the read: step={group.get('step')!r}, state keys {sorted(held)}, dtypes {[str(v.dtype) for v in held.values()]}"]
        try:
            param.grad = torch.ones(4)
            owner.optimizer.step()
            details.append(f"next step: {group.get('step')!r} (upstream: 3)")
            wrong = group.get("step") != 3 or any(v.dtype != torch.float32 for v in held.values())
        except Exception as error:  # noqa: BLE001 - reported
            details.append(f"next step raised {type(error).__name__}: {error}")
            wrong = True
        report(number, wrong and outcome.adopter == "initializer", f"an initializer that {what} is accepted", details)


# --- holes 7 and 8 -------------------------------------------------------------------------------


class StandInAdopter(TEFusedAdamFP32StateAdopter):
    name = "te_fused_adam_fp32_standin"


def trained_state_dict() -> Dict[str, Any]:
    source = FusedAdamStandIn([{"params": [torch.nn.Parameter(torch.ones(3))]}])
    source.param_groups[0]["params"][0].grad = torch.ones(3)
    source.step()
    state_dict = source.state_dict()
    state_dict["state"] = {k: {n: v.clone() for n, v in e.items()} for k, e in state_dict["state"].items()}
    return state_dict


def probe_aliasing() -> None:
    handle = old.register_state_adopter(StandInAdopter(fused_adam_class=FusedAdamStandIn, param_device_type="cpu"), prepend=True)
    try:
        state_dict = trained_state_dict()
        kept = state_dict["state"][0]["exp_avg"].clone()
        owners = [CpuFP32Optimizer(FusedAdamStandIn([{"params": [torch.nn.Parameter(torch.ones(3))]}]), OptimizerConfig()) for _ in range(2)]
        for owner in owners:
            owner.load_state_dict(state_dict)
        first, second = (o.optimizer.state[o.optimizer.param_groups[0]["params"][0]] for o in owners)
        shared = first["exp_avg"].data_ptr() == second["exp_avg"].data_ptr()
        owners[0].optimizer.param_groups[0]["params"][0].grad = torch.ones(3)
        owners[0].optimizer.step()
        details = [f"the two optimizers' exp_avg share storage: {shared}",
                   f"after stepping the first, the second's exp_avg changed: {not torch.equal(second['exp_avg'], kept)}",
                   f"the caller's dict changed: {not torch.equal(state_dict['state'][0]['exp_avg'], kept)}"]  # fmt: skip
        report("7", shared, "one state dict loaded into two FP32Optimizers is shared by both and the caller", details)
    finally:
        handle.remove()
    state_dict = trained_state_dict()
    moment = state_dict["state"][0]["exp_avg"]
    state_dict["state"][0]["exp_avg"] = torch._neg_view(-moment)
    optimizer = FusedAdamStandIn([{"params": [torch.nn.Parameter(torch.ones(3))]}])
    outcome = old.load_inner_optimizer_state_dict(Owner(optimizer), state_dict, registry=registry(StandInAdopter(fused_adam_class=FusedAdamStandIn, param_device_type="cpu")))
    installed = optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"]
    report("8", outcome.adopter is not None and installed.is_neg(), "a negative-bit view is adopted by reference", [f"adopter={outcome.adopter!r}, installed is_neg()={installed.is_neg()}"])


# --- the other medium holes ----------------------------------------------------------------------


class SgdAdopter:
    name = "sgd"

    def decline_reason(self, context: Any) -> None:
        return None

    def adopt(self, context: Any) -> None:
        torch.optim.Optimizer.load_state_dict(context.optimizer, dict(context.state_dict))


def probe_medium() -> None:
    outcomes: List[Any] = []
    interrupting = registry(SgdAdopter())

    def interrupted(outcome: Any) -> None:
        outcomes.append(outcome)
        raise KeyboardInterrupt

    interrupting.register_outcome_hook(interrupted)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9)
    try:
        old.load_inner_optimizer_state_dict(Owner(optimizer), optimizer.state_dict(), registry=interrupting)
    except KeyboardInterrupt:
        pass
    report("medium (Ctrl-C in an outcome hook)", len(outcomes) > 1, "one call gives more than one outcome", [f"outcomes: {len(outcomes)}"])

    errors: List[BaseException] = []
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race is narrow
    for _ in range(200):
        handles = registry()
        handle = handles.register(SgdAdopter())
        barrier = threading.Barrier(8)

        def remove() -> None:
            barrier.wait()
            try:
                handle.remove()
            except BaseException as error:  # noqa: BLE001 - counted
                errors.append(error)

        threads = [threading.Thread(target=remove) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    report("medium (one handle removed from 8 threads)", bool(errors), "a handle removed concurrently raises", [f"{len(errors)} errors in 200 rounds: {sorted({type(e).__name__ for e in errors})}"])

    class Zeroing(SgdAdopter):
        name = "zeroing"

        def decline_reason(self, context: Any) -> str:
            return "exports only"

        def export_decline_reason(self, context: Any) -> None:
            return None

        def export_state_dict(self, context: Any) -> Any:
            for entry in context.optimizer.state.values():
                entry["exp_avg"].zero_()
            raise RuntimeError("exporter exploded")

    optimizer = FusedAdamStandIn([{"params": [torch.nn.Parameter(torch.ones(3))]}])
    optimizer.param_groups[0]["params"][0].grad = torch.ones(3)
    optimizer.step()
    try:
        exported = old.export_inner_optimizer_state_dict(Owner(optimizer), registry=registry(Zeroing()))
        zeroed = not exported["state"][0]["exp_avg"].any()
        words = f"no error; the own state_dict was returned with exp_avg zeroed: {zeroed}"
    except Exception as error:  # noqa: BLE001 - reported
        zeroed, words = False, f"raised {type(error).__name__}: {error}"
    report("medium (exporter zeroes, then raises)", zeroed, "containers restored, contents not, no error", [words])


if __name__ == "__main__":
    print(f"state_adoption from {old.__file__}; torch {torch.__version__}")
    probe_read_targets()
    probe_initializers()
    probe_aliasing()
    probe_medium()
