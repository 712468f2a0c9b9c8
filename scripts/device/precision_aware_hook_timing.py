# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.

"""A GPU probe: how long the precision-aware adopter's hook points take, and how many times they
synchronize with the GPU, against TE FusedAdam's own calls, for one rank's BF16 flat shards of
Qwen2.5-1.5B's parameter shapes (the distributed optimizer's inner parameters), each step timed
between ``torch.cuda.synchronize()`` calls, repeated.

    python3 scripts/device/precision_aware_hook_timing.py --json-out X

Pass 1 is what ``DistributedOptimizer``'s first load does with the inner optimizer: create the
state, ``load_state_dict(state_dict())`` (``state_dict`` is also called inside the load); pass 2
loads the held state handed back (the payload). The adopter's side runs through the registry
(the opt-in adopter, config field set); TE's side is ``initialize_state`` per parameter and its
own ``state_dict``/``load_state_dict``. Synchronizations are counted with
``torch.cuda.set_sync_debug_mode("warn")``. Uses the test owners of ``tests/mcore_owners.py``.
"""

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from mcore_owners import MCORE_PARAM_GROUP_KEYS, precision_aware_owner  # noqa: E402
from read_target_timing import qwen_shapes  # noqa: E402

from megatron.core.optimizer.state_adoption import (  # noqa: E402
    export_inner_optimizer_state_dict,
    initialize_inner_optimizer_state,
    load_inner_optimizer_state_dict,
)


def timed(step: Callable[[], object]) -> Tuple[float, int]:
    """Seconds between synchronizations around ``step``, and the synchronizations inside it."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        start = time.perf_counter()
        step()
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return time.perf_counter() - start, syncs


def optimizer(numels: List[int]) -> torch.optim.Optimizer:
    """TE FusedAdam as MCore's precision-aware optimizer makes it, over BF16 flat shards."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    params = [torch.nn.Parameter(torch.randn(n, device="cuda").bfloat16()) for n in numels]
    return FusedAdam([{"params": params, **MCORE_PARAM_GROUP_KEYS}], lr=1e-3,
                     master_weights=True, store_param_remainders=True,
                     exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)  # fmt: skip


def adopter_side(numels: List[int]) -> Dict[str, Tuple[float, int]]:
    owner = precision_aware_owner(
        optimizer(numels), initialize=False, precision_aware_optimizer_state_adoption=True
    )
    steps: Dict[str, Tuple[float, int]] = {}
    steps["pass 1: initialize"] = timed(lambda: initialize_inner_optimizer_state(owner))
    exported: Dict[str, Any] = {}
    steps["pass 1: state_dict"] = timed(
        lambda: exported.update(export_inner_optimizer_state_dict(owner))
    )
    steps["pass 1: state_dict in the load"] = timed(
        lambda: export_inner_optimizer_state_dict(owner)
    )

    def load() -> None:
        load_inner_optimizer_state_dict(owner, dict(exported), owns_state_dict=True)

    steps["pass 1: load_state_dict"] = timed(load)
    steps["pass 2: load_state_dict (payload)"] = timed(load)
    held = [owner.optimizer.state[p]["exp_avg"] for p in owner.optimizer.param_groups[0]["params"]]
    adopted = len({t.untyped_storage().data_ptr() for t in held}) == 1 and all(
        a is b for a, b in zip(held, (e["exp_avg"] for e in exported["state"].values()))
    )
    if not adopted:  # the adopter did not act: TE's calls ran, the comparison would be void
        raise RuntimeError("the precision-aware adopter did not create, export and keep the state")
    return steps


def te_side(numels: List[int]) -> Dict[str, Tuple[float, int]]:
    fused_adam = optimizer(numels)
    params = fused_adam.param_groups[0]["params"]
    steps: Dict[str, Tuple[float, int]] = {}
    steps["pass 1: initialize"] = timed(
        lambda: [fused_adam.initialize_state(p, True) for p in params]
    )
    exported: Dict[str, Any] = {}
    steps["pass 1: state_dict"] = timed(lambda: exported.update(fused_adam.state_dict()))
    steps["pass 1: state_dict in the load"] = timed(fused_adam.state_dict)
    steps["pass 1: load_state_dict"] = timed(lambda: fused_adam.load_state_dict(exported))
    steps["pass 2: load_state_dict (payload)"] = timed(
        lambda: fused_adam.load_state_dict(fused_adam.state_dict())
    )
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", type=Path, required=True)
    args = parser.parse_args()
    shapes = qwen_shapes(layers=28, hidden=1536, ffn=8960, heads=12, groups=2)
    numels = [int(torch.Size(shape).numel()) for shape in shapes]
    runs: Dict[str, List[Dict[str, Tuple[float, int]]]] = {"adopter": [], "TE": []}
    for _ in range(args.repeats):
        for side, measure in (("adopter", adopter_side), ("TE", te_side)):
            runs[side].append(measure(numels))
            torch.cuda.empty_cache()
    result = {
        "parameters": len(numels),
        "elements": sum(numels),
        "repeats": args.repeats,
        "median_seconds": {
            side: {step: statistics.median(r[step][0] for r in rs) for step in rs[0]}
            for side, rs in runs.items()
        },
        "synchronizations": {side: {step: s for step, (_, s) in rs[0].items()} for side, rs in runs.items()},
    }
    args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
