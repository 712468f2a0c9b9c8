"""The default adopter against real Transformer Engine FusedAdam on the GPU."""

from typing import Any, Dict

import pytest
import torch
from builders import load_through, make_context, registry_of
from gpu_requirements import gpu_only
from te_optimizers import bitwise_equal, params_of, random_step, state_tensors

from megatron.core.optimizer.state_adoption import AdoptionOutcome, StateAdopterRegistry
from megatron.core.optimizer.state_adoption.te_fused_adam import TEFusedAdamFP32StateAdopter

pytestmark = gpu_only

SHAPES = [(4096,), (256, 64), (1000,)]


def _fused_adam(dtype: torch.dtype = torch.float32, **kwargs: Any) -> torch.optim.Optimizer:
    from transformer_engine.pytorch.optimizers import FusedAdam

    generator = torch.Generator(device="cuda").manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=generator, device="cuda").to(dtype)) for s in SHAPES
    ]
    return FusedAdam(params, lr=1e-3, weight_decay=0.01, **kwargs)


def _trained(**kwargs: Any) -> torch.optim.Optimizer:
    optimizer = _fused_adam(**kwargs)
    for seed in range(2):
        random_step(optimizer, seed)
    return optimizer


def _registry() -> StateAdopterRegistry:
    """Only the default adopter, as the build registers it (strict)."""
    return registry_of(TEFusedAdamFP32StateAdopter())


def _load(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any]) -> AdoptionOutcome:
    """Load as a DistributedOptimizer's main branch does, with only the default adopter."""
    return load_through(optimizer, state_dict, _registry())


def _moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    """8 B per parameter: one FP32 exp_avg and one FP32 exp_avg_sq element."""
    return 8 * sum(p.numel() for p in params_of(optimizer))


def _payload(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """FusedAdam's state dict (FP32 unscaled), every tensor cloned: MCore's scaffold shape."""
    state_dict = optimizer.state_dict()
    state_dict["state"] = {k: {n: t.clone() for n, t in s.items()} for k, s in state_dict["state"].items()}
    return state_dict


def test_default_adopter_recognises_real_fused_adam() -> None:
    optimizer = _fused_adam()
    context = make_context(optimizer, _payload(_trained()), owns_state_dict=True)  # the main branch's
    assert TEFusedAdamFP32StateAdopter().decline_reason(context) is None


def test_adoption_installs_by_reference_without_allocating() -> None:
    """The loader measures 8 B x params reused and nothing allocated; CUDA agrees."""
    optimizer = _fused_adam()
    payload = _payload(_trained())
    incoming = [payload["state"][i][k] for i in sorted(payload["state"]) for k in ("exp_avg", "exp_avg_sq")]
    registry = _registry()
    torch.cuda.synchronize()
    allocations_before = torch.cuda.memory_stats()["allocation.all.allocated"]
    allocated_before = torch.cuda.memory_allocated()
    outcome = load_through(optimizer, payload, registry)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations_before
    assert torch.cuda.memory_allocated() == allocated_before
    assert [t.data_ptr() for t in state_tensors(optimizer)] == [t.data_ptr() for t in incoming]
    assert outcome.adopter == "te_fused_adam_fp32" and outcome.method is None
    assert outcome.reused_bytes == _moment_bytes(optimizer) and outcome.allocated_bytes == 0


def test_te_own_loader_allocates_a_second_copy() -> None:
    """The problem being solved: TE's loader allocates every moment again, and the loader's
    measurement of it (with no adopter registered) says so."""
    optimizer = _fused_adam()
    payload = _payload(_trained())
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    outcome = load_through(optimizer, payload, registry_of())
    torch.cuda.synchronize()
    assert outcome.adopter is None and outcome.method == "FusedAdam.load_state_dict"
    assert torch.cuda.memory_allocated() - allocated_before >= _moment_bytes(optimizer)
    assert outcome.allocated_bytes == _moment_bytes(optimizer) and outcome.reused_bytes == 0


def test_adopted_state_and_next_step_equal_te_loader() -> None:
    trained = _trained()
    adopted, by_te = _fused_adam(), _fused_adam()
    outcome = _load(adopted, _payload(trained))
    assert outcome.adopter == "te_fused_adam_fp32" and outcome.allocated_bytes == 0
    by_te.load_state_dict(_payload(trained))
    assert bitwise_equal(state_tensors(adopted), state_tensors(by_te))
    assert [g["step"] for g in adopted.param_groups] == [g["step"] for g in by_te.param_groups]
    random_step(adopted, 7)
    random_step(by_te, 7)
    assert bitwise_equal(params_of(adopted), params_of(by_te))
    assert bitwise_equal(state_tensors(adopted), state_tensors(by_te))


FALLBACK_MODES = {
    "master weights, BF16 moments": dict(
        dtype=torch.bfloat16, master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16
    ),
    "master weights, FP16 moments": dict(
        dtype=torch.bfloat16, master_weights=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16
    ),
    "param remainders": dict(
        dtype=torch.bfloat16,
        master_weights=True,
        store_param_remainders=True,
        exp_avg_dtype=torch.bfloat16,
        exp_avg_sq_dtype=torch.bfloat16,
    ),
    "FP32 params, BF16 moments": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "FP32 master weights over FP32 params": dict(master_weights=True),
}


@pytest.mark.parametrize("mode", sorted(FALLBACK_MODES))
def test_fallback_modes_keep_te_loader_and_its_result(mode: str) -> None:
    kwargs = FALLBACK_MODES[mode]
    trained = _trained(**kwargs)
    ours, upstream = _fused_adam(**kwargs), _fused_adam(**kwargs)
    reason = TEFusedAdamFP32StateAdopter().decline_reason(make_context(ours, _payload(trained)))
    assert reason is not None
    outcome = _load(ours, _payload(trained))
    assert outcome.adopter is None and outcome.declines == (("te_fused_adam_fp32", reason),)
    assert outcome.method == "FusedAdam.load_state_dict" and outcome.allocated_bytes > 0
    upstream.load_state_dict(_payload(trained))
    assert bitwise_equal(state_tensors(ours), state_tensors(upstream))
    random_step(ours, 3)
    random_step(upstream, 3)
    assert bitwise_equal(params_of(ours), params_of(upstream))
    assert bitwise_equal(state_tensors(ours), state_tensors(upstream))
