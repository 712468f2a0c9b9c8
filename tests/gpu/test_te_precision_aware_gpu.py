"""The opt-in precision-aware adopter (built in, not registered by default) with real TE.

Checks both of Megatron-Core's load passes against TE's own loader with real FusedAdam (BF16
moments, TE master weights), and a real MCore precision-aware resume: which loader installed
the state, bitwise equality with the uninterrupted run, and a lower load peak than TE's loader
in the same process.
"""

import dataclasses
import types
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from builders import Owner, load_through, outcome_of, registry_of
from gpu_requirements import gpu_only
from te_optimizers import bitwise_equal, params_of, random_step, state_tensors
from mcore_runs import (
    allocated_now,
    digests,
    free_cuda,
    load_with_peak,
    step_with_peak,
    train_save_control,
)
from outcome_recording import exported_by, loaded_by, recorded_outcomes

from megatron.core.optimizer.state_adoption import (
    StateAdopterRegistry,
    TEFusedAdamPrecisionAwareStateAdopter,
    default_registry,
    export_inner_optimizer_state_dict,
    initialize_inner_optimizer_state,
    load_inner_optimizer_state_dict,
)

pytestmark = gpu_only
NAME = TEFusedAdamPrecisionAwareStateAdopter().name  # an instance's name (a property)

PRECISION_AWARE = types.SimpleNamespace(
    use_precision_aware_optimizer=True, optimizer_cpu_offload=False, optimizer_state_adoption=True
)
SHAPES = [(1 << 20,), (512, 256), (1000,)]
MODES: Dict[str, Dict[str, Any]] = {
    "master remainders": dict(master_weights=True, store_param_remainders=True),
    "FP32 master weights": dict(master_weights=True),
}


def _fused_adam(mode: str) -> torch.optim.Optimizer:
    from transformer_engine.pytorch.optimizers import FusedAdam

    generator = torch.Generator(device="cuda").manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=generator, device="cuda").bfloat16()) for s in SHAPES
    ]
    return FusedAdam(
        params, lr=1e-3, weight_decay=0.01, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, **MODES[mode]
    )


def _scaffold(mode: str) -> Dict[str, Any]:
    """What MCore's scaffold pass offers, filled with a trained optimizer's held tensors."""
    trained = _fused_adam(mode)
    for seed in range(2):
        random_step(trained, seed)
    groups = trained.state_dict()["param_groups"]
    state = {i: {k: t.clone() for k, t in trained.state[p].items()} for i, p in enumerate(params_of(trained))}
    return {"state": state, "param_groups": groups}


def _loaded(mode: str) -> torch.optim.Optimizer:
    optimizer = _fused_adam(mode)
    optimizer.load_state_dict(_scaffold(mode))
    return optimizer


def _export(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The adopter's export, which MCore's payload pass hands back: the held tensors."""
    state_dict = torch.optim.Optimizer.state_dict(optimizer)
    return dict(state_dict, state={k: dict(e) for k, e in state_dict["state"].items()})


def _registry() -> StateAdopterRegistry:
    """Only the precision-aware adopter (strict)."""
    return registry_of(TEFusedAdamPrecisionAwareStateAdopter())


def _same_as_te(adopted: torch.optim.Optimizer, by_te: torch.optim.Optimizer) -> None:
    assert bitwise_equal(state_tensors(adopted), state_tensors(by_te))
    strip = lambda o: [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]  # noqa: E731
    assert strip(adopted) == strip(by_te)
    assert {k: v.item() for p in params_of(adopted) for k, v in adopted._scales.get(p, {}).items()} == {
        k: v.item() for p in params_of(by_te) for k, v in by_te._scales.get(p, {}).items()
    }


@pytest.mark.parametrize("mode", sorted(MODES))
def test_initialization_is_te_initialize_state_in_one_allocation_per_dtype(mode: str) -> None:
    """The state created before the read is TE's own, bit for bit, and TE's step from it is TE's
    step from its own initialization."""
    ours, by_te = _fused_adam(mode), _fused_adam(mode)
    registry = _registry()
    outcome = outcome_of(registry, lambda: initialize_inner_optimizer_state(
        Owner(ours, config=PRECISION_AWARE), registry=registry))  # fmt: skip
    for param in params_of(by_te):
        by_te.initialize_state(param, by_te.store_param_remainders and param.dtype == torch.bfloat16)
    assert outcome.adopter == NAME
    _same_as_te(ours, by_te)
    held = state_tensors(ours)
    assert len({t.untyped_storage().data_ptr() for t in held}) == len({t.dtype for t in held})
    random_step(ours, 3)
    random_step(by_te, 3)
    assert bitwise_equal(params_of(ours), params_of(by_te))
    assert bitwise_equal(state_tensors(ours), state_tensors(by_te))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_scaffold_pass_installs_by_reference_equal_to_te_loader(mode: str) -> None:
    adopted, by_te, scaffold = _fused_adam(mode), _fused_adam(mode), _scaffold(mode)
    outcome = load_through(adopted, scaffold, _registry(), config=PRECISION_AWARE)
    assert outcome.adopter == NAME and outcome.allocated_bytes == 0
    assert all(t is scaffold["state"][i][k] for i, p in enumerate(params_of(adopted)) for k, t in adopted.state[p].items())
    by_te.load_state_dict(_scaffold(mode))
    _same_as_te(adopted, by_te)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_payload_pass_keeps_held_state_equal_to_te_loader(mode: str) -> None:
    adopted, by_te = _loaded(mode), _loaded(mode)
    held = state_tensors(adopted)
    outcome = load_through(adopted, _export(adopted), _registry(), config=PRECISION_AWARE)
    assert outcome.adopter == NAME and all(a is b for a, b in zip(state_tensors(adopted), held))
    by_te.load_state_dict(by_te.state_dict())
    _same_as_te(adopted, by_te)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_payload_pass_allocates_nothing_and_next_step_equals_te(mode: str) -> None:
    """The held BF16 state is kept as it is, after a NaN check whose transient is a scalar per
    tensor: the load allocates next to nothing where TE casts the whole payload to new tensors."""
    adopted, by_te = _loaded(mode), _loaded(mode)
    held = state_tensors(adopted)
    owner, registry = Owner(adopted, config=PRECISION_AWARE), _registry()
    peaks = []
    for optimizer, load, export in (
        (adopted, lambda sd: load_inner_optimizer_state_dict(owner, sd, owns_state_dict=True, registry=registry), _export),
        (by_te, by_te.load_state_dict, lambda o: o.state_dict()),
    ):
        state_dict = export(optimizer)
        free_cuda()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        load(state_dict)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        del state_dict
    assert all(a is b for a, b in zip(state_tensors(adopted), held)) and len(state_tensors(adopted)) == len(held)
    assert peaks[0] <= (1 << 16) < peaks[1], peaks
    assert bitwise_equal(state_tensors(adopted), state_tensors(by_te))
    random_step(adopted, 7)
    random_step(by_te, 7)
    assert bitwise_equal(params_of(adopted), params_of(by_te))
    assert bitwise_equal(state_tensors(adopted), state_tensors(by_te))


def test_mcore_precision_aware_resume_adopts_both_passes(tmp_path: Path, caplog) -> None:
    from mcore_gpt import PRESETS, build_gpt_and_optimizer, distributed_optimizers, make_case

    case = make_case("precision_aware_bf16", PRESETS["tiny"])
    control = train_save_control(case, tmp_path / "checkpoint")
    peaks = {}
    # TE's loader: adoption switched off, upstream's code and nothing else (whatever is installed)
    for label, run in (("te_loader", dataclasses.replace(case, adoption=False)), ("opted_in", case)):
        registered = [a.name for a in default_registry().adopters()]
        handle = None
        if label == "opted_in" and NAME not in registered:
            handle = default_registry().register(TEFusedAdamPrecisionAwareStateAdopter())
        try:
            caplog.clear()
            start = allocated_now()
            model_chunks, optimizer = build_gpt_and_optimizer(run)
            inner_optimizers = len(list(distributed_optimizers(optimizer)))
            with recorded_outcomes() as outcomes:
                peaks[label] = load_with_peak(model_chunks, optimizer, run, tmp_path / "checkpoint", caplog)
        finally:
            if handle is not None:
                handle.remove()
        if label == "opted_in":  # the common state's export comes before the state is created
            assert loaded_by(outcomes) == [NAME] * 2 * inner_optimizers, outcomes
            assert sorted(exported_by(outcomes), key=str) == [None] * inner_optimizers + [NAME] * 3 * inner_optimizers
        else:
            assert outcomes == []
        assert digests(model_chunks, optimizer) == control["saved"]
        result, _ = step_with_peak(model_chunks, optimizer, run, start)
        assert result.loss == control["loss"]
        assert digests(model_chunks, optimizer) == control["after_step"]
        del model_chunks, optimizer
        free_cuda()
    assert peaks["opted_in"] < peaks["te_loader"], peaks


@pytest.mark.parametrize("mode", sorted(MODES))
def test_exported_held_state_reloads_without_new_state_and_equals_te(mode: str) -> None:
    """MCore's payload pass with the export: read the state dict, hand it back to the load."""
    ours, by_te = _loaded(mode), _loaded(mode)
    held = state_tensors(ours)
    registry = _registry()
    owner = Owner(ours, config=PRECISION_AWARE)
    free_cuda()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    exported = export_inner_optimizer_state_dict(owner, registry=registry)
    outcome = outcome_of(
        registry, lambda: load_inner_optimizer_state_dict(owner, exported, owns_state_dict=True, registry=registry)
    )
    del exported
    torch.cuda.synchronize()
    our_peak = torch.cuda.max_memory_allocated() - before
    assert outcome.adopter == NAME
    assert all(a is b for a, b in zip(state_tensors(ours), held)) and len(state_tensors(ours)) == len(held)
    largest = max(p.numel() for p in params_of(ours))
    assert our_peak <= 6 * largest + (1 << 16), our_peak  # one chunk's conversion at most
    by_te.load_state_dict(by_te.state_dict())  # upstream: FP32 copies, then TE's loader
    assert bitwise_equal(state_tensors(ours), state_tensors(by_te))
    random_step(ours, 7)
    random_step(by_te, 7)
    assert bitwise_equal(params_of(ours), params_of(by_te))
    assert bitwise_equal(state_tensors(ours), state_tensors(by_te))
