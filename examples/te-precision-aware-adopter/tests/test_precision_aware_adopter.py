"""The opt-in precision-aware adopter against TE's loader, reproduced by the CPU stand-in.

TE cannot load without a GPU: ``FusedAdamStandIn`` (tests/fused_adam_standin.py of the
main repository) reproduces FusedAdam's precision-aware loading — BF16 moments upcast and
copied back, master weights in FP32 or as int16 remainders, ``_scales`` — and
``initialize_state``. On CPU, MCore's OptimizerConfig refuses the precision-aware flag
without TE, so the owner config here is a namespace with the two flags the adopter reads.
"""

import sys
import types
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any, Dict, List

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
)
from megatron.core.optimizer.state_adoption.testing import (  # noqa: E402
    assert_adoption_matches_own_loader,
    assert_check_is_side_effect_free,
)

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

    avoided = assert_adoption_matches_own_loader(
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
    assert avoided == bytes_per_element * sum(s[0] * (s[1] if len(s) > 1 else 1) for s in SHAPES)


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda o, sd, ctx: ctx.update(config=FP32_MODE), "use_precision_aware_optimizer is not set"),
        (lambda o, sd, ctx: o.register_load_state_dict_post_hook(lambda opt: None), "post-hook"),
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
    ids=["FP32 owner", "post-hook", "FP16 moments", "FP32 incoming moment", "missing master", "master not int16"],
)
def test_declines(change: Any, reason: str) -> None:
    optimizer = _optimizer(**MODES["BF16 params, master remainders"])
    state_dict = _scaffold(**MODES["BF16 params, master remainders"])
    context_kwargs = _context_kwargs()
    change(optimizer, state_dict, context_kwargs)
    context = StateAdoptionContext(optimizer, state_dict, **context_kwargs)
    answer = assert_check_is_side_effect_free(_adopter(), context)
    assert answer is not None and reason in answer, answer


def test_installed_plugin_is_discovered_through_its_entry_point() -> None:
    try:
        distribution("mcore-te-precision-aware-adopter")
    except PackageNotFoundError:
        pytest.skip("the plugin is not installed (pip install examples/te-precision-aware-adopter)")
    names = [adopter.name for adopter in StateAdopterRegistry().adopters()]
    assert names == ["te_fused_adam_precision_aware"]


# --- Payload pass: MCore offers FusedAdam's own state_dict() (FP32 copies of BF16 moments) ---


def _loaded(mode: str) -> FusedAdamStandIn:
    """An optimizer holding state, as after MCore's scaffold pass and the checkpoint read."""
    optimizer = _optimizer(**MODES[mode])
    optimizer.load_state_dict(_scaffold(**MODES[mode]))
    return optimizer


def _payload_context(optimizer: FusedAdamStandIn, state_dict: Dict[str, Any]) -> StateAdoptionContext:
    return StateAdoptionContext(optimizer, state_dict, **_context_kwargs())


@pytest.mark.parametrize("mode", sorted(MODES))
def test_payload_pass_keeps_the_held_state_and_equals_te_loader(mode: str) -> None:
    made: List[FusedAdamStandIn] = []
    held: List[Dict[Any, Dict[str, torch.Tensor]]] = []
    allocations: List[int] = []

    def make_optimizer() -> FusedAdamStandIn:
        made.append(_loaded(mode))
        held.append({p: dict(s) for p, s in made[-1].state.items()})
        allocations.append(made[-1].allocations)
        return made[-1]

    avoided = assert_adoption_matches_own_loader(
        _adopter(), make_optimizer, lambda: made[-1].state_dict(), _context_kwargs()
    )
    adopted, by_te = made
    assert adopted.allocations == allocations[0]  # nothing allocated
    assert by_te.allocations > allocations[1]  # TE's loader rebuilt every tensor
    for param, entries in held[0].items():
        assert all(adopted.state[param][key] is tensor for key, tensor in entries.items())
    assert avoided == sum(t.nbytes for entries in held[0].values() for t in entries.values())


def _changed(state_dict: Dict[str, Any], position: int, key: str, value: float) -> Dict[str, Any]:
    tensor = state_dict["state"][position][key].clone()
    tensor.view(-1)[3] = value
    state_dict["state"][position][key] = tensor
    return state_dict


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda sd, o: _changed(sd, 1, "exp_avg", 0.123456), "parameter 1: incoming exp_avg differs"),
        (lambda sd, o: _changed(sd, 2, "master_param", 17), "parameter 2: incoming master_param differs"),
        (
            lambda sd, o: sd["state"][0].__setitem__("exp_avg_sq", sd["state"][0]["exp_avg_sq"].double()),
            "parameter 0: incoming exp_avg_sq is torch.float64, not torch.float32",
        ),
        (lambda sd, o: sd["state"][1].pop("master_param"), "parameter 1: the incoming state does not have"),
        (lambda sd, o: o._scales[o.param_groups[0]["params"][0]]["exp_avg"].fill_(2.0), "scale of exp_avg is not one"),
        (lambda sd, o: o.state.pop(o.param_groups[0]["params"][2]), "parameter 2: the held state has keys None"),
    ],
    ids=["moment differs", "remainder differs", "FP64 incoming", "missing key", "scale not one", "no held state"],
)
def test_payload_pass_declines_what_would_change_the_held_state(change: Any, reason: str) -> None:
    optimizer = _loaded("BF16 params, master remainders")
    state_dict = optimizer.state_dict()
    change(state_dict, optimizer)
    answer = assert_check_is_side_effect_free(_adopter(), _payload_context(optimizer, state_dict))
    assert answer is not None and reason in answer and "not a scaffold to adopt" in answer, answer


def test_payload_pass_compares_the_bits_te_would_store() -> None:
    """A value below BF16's resolution loads to the same bits (kept); -0.0 over +0.0 does not."""
    optimizer = _loaded("BF16 params, FP32 master weights")
    param = optimizer.param_groups[0]["params"][0]
    optimizer.state[param]["exp_avg"].view(-1)[5] = 0.0
    held = optimizer.state[param]["exp_avg"]
    nudged = optimizer.state_dict()
    value = nudged["state"][0]["exp_avg"].view(-1)[4].item()
    nudged["state"][0]["exp_avg"].view(-1)[4] = value * (1 + 2**-12)  # rounds back to the held BF16
    assert _adopter().decline_reason(_payload_context(optimizer, nudged)) is None
    negative_zero = optimizer.state_dict()
    negative_zero["state"][0]["exp_avg"].view(-1)[5] = -0.0
    answer = _adopter().decline_reason(_payload_context(optimizer, negative_zero))
    assert answer is not None and "parameter 0: incoming exp_avg differs" in answer
    assert optimizer.state[param]["exp_avg"] is held


@pytest.mark.parametrize("chunk_elements", [1, 7, 64, 1 << 22])
def test_chunked_comparison_finds_a_difference_in_any_chunk(chunk_elements: int) -> None:
    from mcore_te_precision_aware_adopter.held_state import loads_to_held_bits

    held = torch.rand(100).bfloat16()
    incoming = held.float()
    assert loads_to_held_bits(incoming, held, chunk_elements)
    for position in (0, 63, 99):
        changed = incoming.clone()
        changed[position] += 1.0
        assert not loads_to_held_bits(changed, held, chunk_elements)
