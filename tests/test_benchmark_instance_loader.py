"""``--instance-loader bridge-like``: an instance-level ``load_state_dict`` on every inner FusedAdam.

Covers the benchmark's own loader (installed on each inner optimizer, counted, by reference,
removed after the load even when it fails, refused where PyTorch's loader alone would be
wrong), the installed build's real loader leaving such an instance to its own method without
asking any adopter and calling it once, the whole story on the fake GPU (both sides by reference: the same load peak, saving
0; which path ran, per rank, in the report), and the ``--check`` rules for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmark_fakes import install_fake_gpu, run_phases_in_process, standin_is_te_fused_adam
from benchmark_results import column, control, resume
from builders import Owner, cloned_state_dict, fresh_standin, state_tensors, trained_standin

from benchmarks.resume_benchmark import cli
from benchmarks.resume_benchmark.results import installed_by_text, recording_outcomes
from benchmarks.resume_benchmark.cases import BRIDGE_LIKE, PRESETS, make_case
from benchmarks.resume_benchmark.instance_loader import installed_instance_loaders
from benchmarks.resume_benchmark.launch import LayoutError, ParallelLayout, validate_layout
from benchmarks.resume_benchmark.summary import (
    case_meets_expectations,
    instance_loader_problems,
    summarize_case,
)
from megatron.core.optimizer.state_adoption import load_inner_optimizer_state_dict

FP32 = "te_fused_adam_fp32"


def test_the_loader_runs_pytorchs_loader_by_reference_and_counts() -> None:
    optimizers = [fresh_standin(), fresh_standin()]
    payload = cloned_state_dict(trained_standin())
    incoming = [t for s in payload["state"].values() for _, t in sorted(s.items())]
    with installed_instance_loaders(BRIDGE_LIKE, optimizers) as loaders:
        assert loaders is not None
        assert all("load_state_dict" in vars(o) for o in optimizers)
        optimizers[1].load_state_dict(payload)
        optimizers[1].load_state_dict(payload)
        assert loaders.to_json() == {"kind": BRIDGE_LIKE, "optimizers": ["FusedAdamStandIn"] * 2,
                                     "calls_per_optimizer": [0, 2], "calls": 2}  # fmt: skip
    assert optimizers[1].allocations == 0  # TE's allocate-and-copy skipped
    assert [t.data_ptr() for t in state_tensors(optimizers[1])] == [t.data_ptr() for t in incoming]
    assert all("load_state_dict" not in vars(o) for o in optimizers)  # the class's method again
    optimizers[0].load_state_dict(payload)
    assert optimizers[0].allocations > 0 and loaders.calls == [0, 2]


def test_the_loader_is_removed_when_the_load_fails() -> None:
    optimizer = fresh_standin()
    with pytest.raises(RuntimeError, match="load failed"):
        with installed_instance_loaders(BRIDGE_LIKE, [optimizer]):
            raise RuntimeError("load failed")
    assert "load_state_dict" not in vars(optimizer)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"master_weights": True}, "without master weights"),
        ({"exp_avg_dtype": __import__("torch").bfloat16}, "non-FP32 moments"),
    ],
)
def test_the_loader_refuses_what_pytorchs_loader_would_get_wrong(kwargs: dict[str, Any], message: str) -> None:
    good, bad = fresh_standin(), fresh_standin(**kwargs)
    with pytest.raises(ValueError, match=message):
        with installed_instance_loaders(BRIDGE_LIKE, [good, bad]):
            pass
    assert "load_state_dict" not in vars(good)  # nothing was installed
    with pytest.raises(ValueError, match="unknown instance loader"):
        with installed_instance_loaders("other", [good]):
            pass
    with installed_instance_loaders(None, [good]) as nothing:
        assert nothing is None and "load_state_dict" not in vars(good)


def test_the_builds_loader_leaves_the_instance_to_its_loader_and_calls_it_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No adopter is asked; the outcome records the instance's method as what ran, and what it
    installed by reference as reused.

    Hole 6: under an instance-level loader the outcome read as "0 bytes avoided".
    """
    standin_is_te_fused_adam(monkeypatch)
    optimizer = fresh_standin()
    with installed_instance_loaders(BRIDGE_LIKE, [optimizer]) as loaders, recording_outcomes() as outcomes:
        load_inner_optimizer_state_dict(Owner(optimizer), cloned_state_dict(trained_standin()))
    assert loaders is not None and loaders.calls == [1]
    (outcome,) = outcomes or []
    assert outcome["adopter"] is None and outcome["declines"] == []
    assert outcome["method"] == "load_state_dict set on the FusedAdamStandIn instance"
    assert "instance has its own load_state_dict" in outcome["fallback_reason"]
    assert outcome["reused_bytes"] == 8 * sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    assert outcome["allocated_bytes"] == 0
    record = {"adopters": [FP32], "outcomes": outcomes}
    assert installed_by_text(record, 1) == "instance loader ×1"
    assert installed_by_text(record, 0) == "instance loader ×1 (instance loader ran ×0)"
    assert installed_by_text(None, 2) == "instance loader ×2"  # upstream: the count alone


def test_precision_aware_is_refused_with_an_instance_loader() -> None:
    cases = [make_case("precision_aware_bf16", PRESETS["tiny"], instance_loader=BRIDGE_LIKE)]
    with pytest.raises(LayoutError, match="drop precision_aware_bf16"):
        validate_layout(1, 1, 1, None, cases, PRESETS["tiny"])
    with pytest.raises(SystemExit) as info:
        cli.main(["--instance-loader", "bridge-like"])  # --cases all includes it
    assert info.value.code == 2


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[int, dict[str, Any], str]:
    from test_benchmark_story import _cli

    install_fake_gpu(monkeypatch)
    standin_is_te_fused_adam(monkeypatch)
    run_phases_in_process(monkeypatch)
    return _cli(tmp_path, monkeypatch, "--instance-loader", BRIDGE_LIKE, *extra)


def test_the_story_with_a_bridge_like_loader_on_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    status, doc, markdown = _run(
        tmp_path, monkeypatch, "--cases", "dp_reshardable,moe", "--nproc-per-node", "2", "--check"
    )
    assert status == 0, [c.get("failed_expectations") or c.get("detail") for c in doc["cases"]]
    assert doc["settings"]["instance_loader"] == BRIDGE_LIKE
    dense, moe = doc["cases"]
    for case, optimizers in ((dense, 1), (moe, 2)):
        assert case["instance_loader"] == BRIDGE_LIKE and case["expected_saving_bytes_per_param"] == 0
        for label in ("upstream", "build"):
            for side in case["rank_sides"][label]:
                assert side["instance_loader"]["calls"] == 2 * optimizers  # both load passes
                assert side["load_over_baseline_bytes_per_param"] == 8.0  # by reference
        for rank in case["ranks"]:
            assert rank["bytes_avoided"] == 0 and rank["bytes_avoided_as_expected"]
    assert column(markdown, "state installed by") == {
        "control (uninterrupted)": ["—"] * 4,
        "upstream": ["instance loader ×2"] * 2 + ["instance loader ×4"] * 2,
        "build": ["instance loader ×2"] * 2 + ["instance loader ×4"] * 2,
    }
    assert set(column(markdown, "avoided ÷ (8 B × params)")["build"]) == {"expected 0"}
    assert "| moe (2 DistributedOptimizers, bridge-like instance loader) [TP 1, EP 1, DP 2] |" in markdown
    assert "instance-level load_state_dict (PyTorch's loader only) was set on every inner FusedAdam" in markdown
    assert (
        "both sides; build ran load_state_dict set on the FusedAdamStandIn instance (the "
        "FusedAdamStandIn instance has its own load_state_dict"
    ) in markdown
    assert "build declines" not in markdown  # no adopter was asked
    json.dumps(doc)


def _side(calls: int, *adopters: str | None) -> dict[str, Any]:
    outcomes = [{"hook_point": "load", "adopter": a, "declines": []} for a in adopters]
    return {"instance_loader": {"calls": calls}, "state_adoption": {"outcomes": outcomes}}


def test_instance_loader_rules() -> None:
    assert instance_loader_problems("build", _side(2, None, None)) == []
    assert instance_loader_problems("upstream", {"instance_loader": {"calls": 2}}) == []
    assert instance_loader_problems("upstream", {"instance_loader": {"calls": 0}}) == [
        "upstream's instance loader never ran"]  # fmt: skip
    assert instance_loader_problems("build", _side(1, None, None)) == [
        "the build's instance loader ran ×1 for 2 load fallback(s) (expected exactly once each, "
        "at least once)"]  # fmt: skip
    adopted = instance_loader_problems("build", _side(0, FP32, FP32))
    assert adopted[0] == f"adopter {FP32} installed the state over the instance loader"
    assert instance_loader_problems("build", {"instance_loader": {"calls": 2}}) == [
        "the build recorded no outcomes, so its instance-loader path cannot be verified"]  # fmt: skip


def test_check_fails_where_an_adopter_bypassed_the_instance_loader() -> None:
    case = make_case("dp_reshardable", PRESETS["tiny"], instance_loader=BRIDGE_LIKE)
    adopted = {"adopters": [FP32], "outcomes": [{"hook_point": "load", "adopter": FP32, "declines": []}]}
    build = {**resume("build", 100, 8.0, adoption=adopted), "instance_loader": {"calls": 0}}
    upstream = {**resume("upstream", 100, 8.0), "instance_loader": {"calls": 2}}
    judged = summarize_case(case, ParallelLayout(), [control(100)], {"upstream": [upstream], "build": [build]})
    assert judged["status"] == "ok" and not case_meets_expectations(judged)
    assert judged["failed_expectations"] == [
        f"rank 0: adopter {FP32} installed the state over the instance loader"
    ]
