"""The resume benchmark's command line, configurations and ``--check``, on the CPU.

Whole invocations run the real driver, launcher and probe with the stand-in ``pretrain_gpt.py``
of tests/test_megatron_lm_client.py (its console lines, TensorBoard scalars and checkpoints);
only the side probes are replaced (this machine has one megatron-core, no GPU and no TE), by
records of the shape :mod:`benchmarks.resume_benchmark.side_probe` writes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from test_megatron_lm_client import USER_ARGS, _fake_megatron_lm, stand_in_megatron_core

from benchmarks.resume_benchmark import cli
from benchmarks.resume_benchmark.configs import (
    CONFIGURATIONS,
    DEFAULT_CONFIGURATIONS,
    SIZES,
    Expectation,
    parse_configurations,
)
from benchmarks.resume_benchmark.megatron_lm import OWNED_ARGUMENTS, base_arguments
from benchmarks.resume_benchmark.report import (
    expectation_problems,
    markdown_report,
    run_numbers,
    within_training_peak,
)
from benchmarks.resume_benchmark.sides import Side

MIB = 1 << 20


def test_configurations_parse_and_cover_every_load_path() -> None:
    assert parse_configurations("all") == list(CONFIGURATIONS)
    assert parse_configurations(" moe, dp-reshardable ") == ["moe", "dp-reshardable"]
    for bad in ("", "moe,nope"):
        with pytest.raises(ValueError, match="choose from all, dp-reshardable"):
            parse_configurations(bad)
    assert {c.expectation for c in CONFIGURATIONS.values()} == set(Expectation)
    for configuration in CONFIGURATIONS.values():
        for size in SIZES:
            arguments = configuration.script_arguments(size)
            assert not {a for a in arguments if a.startswith("--")} & OWNED_ARGUMENTS
            base_arguments(arguments, apex_fusion=False)  # the client runs every one of them
    fsdp = CONFIGURATIONS["megatron-fsdp"].script_arguments("tiny")
    assert fsdp[fsdp.index("--ckpt-format") + 1] == "fsdp_dtensor"
    assert "--use-distributed-optimizer" not in CONFIGURATIONS["non-distributed-fp32"].arguments
    assert "--bf16" not in CONFIGURATIONS["non-distributed-fp32"].arguments
    # llama: SwiGLU at 3.5 x hidden (Llama 3's 14,336 at hidden 4,096) in place of the size's 4 x
    llama = {size: CONFIGURATIONS["llama"].script_arguments(size) for size in SIZES}
    assert {size: a[a.index("--ffn-hidden-size") + 1] for size, a in llama.items()} == {
        "1b": "7168", "small": "3584", "tiny": "896"}  # fmt: skip
    assert all(a.count("--ffn-hidden-size") == 1 for a in llama.values())
    assert {"--swiglu", "--group-query-attention", "--disable-bias-linear"} <= set(llama["1b"])


def test_configs_and_own_arguments_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--configs", "moe", "--", *USER_ARGS])
    assert exited.value.code == 2 and "not both" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        cli.main(["--", *USER_ARGS, "--save", "/x"])
    assert exited.value.code == 2 and "--save: set by the client" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--configs", "nope"])
    args = cli.build_parser().parse_args(["--size", "tiny", "--configs", "moe,precision-aware"])
    runs = cli.requested_runs(args)
    assert [(c["name"], c["expectation"]) for c, _ in runs] == [
        ("moe", "ADOPTS"),
        ("precision-aware", "KEEPS_LOADER"),
    ]
    assert runs[0][1][: len(SIZES["tiny"])] == list(SIZES["tiny"])
    default = cli.requested_runs(cli.build_parser().parse_args([]))
    assert [c["name"] for c, _ in default] == list(DEFAULT_CONFIGURATIONS)
    assert DEFAULT_CONFIGURATIONS == tuple(CONFIGURATIONS)  # every one passes on an H200
    every = cli.requested_runs(cli.build_parser().parse_args(["--configs", "all"]))
    assert [c["name"] for c, _ in every] == list(CONFIGURATIONS)
    (own,) = cli.requested_runs(cli.build_parser().parse_args(["--", *USER_ARGS]))
    assert own == ({"name": "your arguments", "description": None, "expectation": None}, USER_ARGS)


# --------------------------------------------------------------------------- whole invocations


def _side_probe(version: str, adoption: bool, file: str) -> dict[str, Any]:
    return {
        "python": "3.12", "torch": "2.x", "torch_cuda": None, "cuda_available": True,
        "gpu_name": "stand-in", "driver": "n/a",
        "transformer_engine": {"version": "2.20.2", "file": "/te", "error": None},
        "megatron_core": {"version": version, "file": file, "site": str(Path(file).parents[2]),
                          "has_state_adoption": adoption, "has_outcome_hooks": adoption,
                          "error": None},
    }  # fmt: skip


def _invoke(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str, release: str = "0.19.2",
    upstream_release: str | None = None,
) -> tuple[int, Path]:  # fmt: skip
    """``cli.main`` with the stand-in Megatron-LM tree; the side probes say ``release``; both
    sides are sites with a stand-in megatron-core (the workers need none)."""
    probed: list[str] = []

    def probe(workspace: Any, side: Side) -> dict[str, Any]:
        probed.append(side.label)
        if side.label == "build":
            return _side_probe(f"{release}+stateadoption", True, "/b/megatron/core/__init__.py")
        version = upstream_release or release
        return _side_probe(version, False, "/upstream/megatron/core/__init__.py")

    monkeypatch.setattr(cli, "_probe", probe)
    monkeypatch.setattr(cli, "check_cuda", lambda needed=1: None)
    tree = _fake_megatron_lm(tmp_path / "Megatron-LM")
    up, build = (stand_in_megatron_core(tmp_path / name) for name in ("up", "build"))
    out = tmp_path / "out"
    argv = ["--megatron-lm", str(tree), "--upstream", str(up), "--build", str(build),
            "--work-dir", str(tmp_path / "work"), "--train-iters", "4", "--resume-at", "2",
            "--json-out", str(out / "r.json"), "--markdown-out", str(out / "r.md"), *extra]  # fmt: skip
    out.mkdir()
    status = cli.main(argv)
    assert probed[:2] == ["build", "upstream"]
    return status, out


def test_own_arguments_run_once_and_the_report_re_renders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = tmp_path / "figures"
    status, out = _invoke(
        tmp_path, monkeypatch, "--deterministic", "--figures-dir", str(figures), "--", *USER_ARGS
    )
    assert status == cli.EXIT_OK
    assert (figures / "figures.md").read_text() == ""  # no CUDA, so no timeline to draw
    document = json.loads((out / "r.json").read_text())
    (run,) = document["runs"]
    assert run["configuration"]["name"] == "your arguments" and run["script_args"] == USER_ARGS
    assert document["sides"]["upstream"]["version"] == "0.19.2"
    assert document["sides"]["build"]["version"] == "0.19.2+stateadoption"
    markdown = (out / "r.md").read_text()
    assert markdown == markdown_report(document)  # the committed form re-renders
    assert "- upstream: megatron-core 0.19.2 from `/upstream/megatron/core/__init__.py`" in markdown
    lines = markdown.splitlines()
    header = next(line for line in lines if line.startswith("| configuration | side"))
    row = next(line for line in lines if line.startswith("| your arguments | build"))
    cells = dict(zip(header.strip("| ").split(" | "), row.strip("| ").split(" | ")))
    assert cells["losses 3..4 equal"] == cells["checkpoints after 4 identical"] == "yes"
    assert "Checkpoints saved at iteration 4 by the two resumes: identical" in markdown


@pytest.mark.parametrize("release", ["0.16.1", "0.18.2"])
def test_built_in_configurations_of_another_release_and_check_failing(
    release: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The stand-in saves nothing on the build side, so ``--check`` must fail the configuration
    that predicts 8 B/param and pass the one that predicts no saving."""
    argv = ["--configs", "dp-reshardable,precision-aware", "--size", "tiny", "--check"]
    status, out = _invoke(tmp_path, monkeypatch, *argv, release=release)
    assert status == cli.EXIT_EXPECTATION_MISSED
    err = capsys.readouterr().err
    assert "--check: dp-reshardable: the build's state was installed by" in err
    assert "--check: precision-aware: avoided n/a MiB, expected 0.0 MiB" in err  # no CUDA: no peaks
    document = json.loads((out / "r.json").read_text())
    assert [r["configuration"]["name"] for r in document["runs"]] == [
        "dp-reshardable",
        "precision-aware",
    ]
    assert document["runs"][0]["script_args"][:2] == ["--num-layers", "2"]
    assert document["runs"][0]["megatron_lm"].startswith("checkout ")
    assert f"release 0.19, the build is megatron-core {release}+stateadoption" in " ".join(
        document["runs"][0]["notes"]
    )  # the stand-in tree is 0.19's: the user is told to use the matching branch


def test_an_upstream_of_another_release_stops_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out = _invoke(
        tmp_path, monkeypatch, "--", *USER_ARGS, release="0.18.2", upstream_release="0.19.2"
    )
    assert status == cli.EXIT_WRONG_SIDES
    assert "plain megatron-core 0.18.2" in capsys.readouterr().err
    assert not (tmp_path / "work" / "your-arguments").exists() and not (out / "r.json").exists()


# --------------------------------------------------------------------------- --check


def _measured_run(expectation: str | None, build_rise: int, adopter: str | None) -> dict[str, Any]:
    elements = 1_000_000_000
    outcome = {"hook_point": "load", "adopter": adopter,
               "optimizer": f"FusedAdam 0x1 (10 params, {elements:,} elements)"}  # fmt: skip
    installed = f"{adopter} ×2" if adopter else "own loader ×2"
    return {
        "configuration": {"name": "c", "expectation": expectation},
        "plan": {"train_iters": 10, "resume_at": 5, "deterministic": True},
        "phases": {
            "train": {"exit_code": 0},
            "uninterrupted": {"exit_code": 0, "parameters": elements, "max_allocated_bytes": 30_000 * MIB},
            "resume-upstream": {"exit_code": 0, "load_peak_over_baseline": 16 * elements,
                                "first_memory_report": [6, 31_000.0]},
            "resume-build": {"exit_code": 0, "load_peak_over_baseline": build_rise,
                             "first_memory_report": [6, 30_000.0], "installed_by": installed,
                             "outcomes": [outcome, outcome]},
        },  # fmt: skip
        "loss_differences": {"upstream": [], "build": []},
        "checkpoint_differences": [],
    }


def test_check_holds_the_build_to_each_expectation() -> None:
    adopted = _measured_run("ADOPTS", 8 * 1_000_000_000, "te_fused_adam_fp32")
    assert expectation_problems(adopted) == []
    numbers = run_numbers(adopted)
    assert (
        numbers.expected == numbers.avoided == 8_000_000_000 and numbers.elements == 1_000_000_000
    )
    short = _measured_run("ADOPTS", 9 * 1_000_000_000, "te_fused_adam_fp32")
    assert expectation_problems(short) == [
        f"c: the build's load peak over pre-load {9e9 / MIB:,.1f} MiB, expected {8e9 / MIB:,.1f} MiB"
    ]
    # the floor's allowance: 8.05 B per element passes, 8.06 does not; whatever upstream copied
    # (SwiGLU's fc1 through its factory) the build is held to its own floor
    for rise, problems in ((8_050_000_000, 0), (8_060_000_000, 1)):
        assert (
            len(expectation_problems(_measured_run("ADOPTS", rise, "te_fused_adam_fp32")))
            == problems
        )
    swiglu = _measured_run("ADOPTS", 8 * 1_000_000_000, "te_fused_adam_fp32")
    swiglu["phases"]["resume-upstream"]["load_peak_over_baseline"] = 16_800_000_000
    assert expectation_problems(swiglu) == []
    declined = _measured_run("KEEPS_LOADER", 16 * 1_000_000_000, None)
    assert expectation_problems(declined) == []
    assert expectation_problems(_measured_run("KEEPS_LOADER", 8 * 1_000_000_000, None))
    plugin = _measured_run("KEEPS_LOADER", 6 * 1_000_000_000, "te_fused_adam_precision_aware")
    assert run_numbers(plugin).expected is None and expectation_problems(plugin) == []
    broken = copy.deepcopy(adopted)
    broken["loss_differences"]["build"] = ["7: 1 != 2"]
    broken["checkpoint_differences"] = ["optimizer.state.exp_avg"]
    broken["phases"]["resume-build"]["first_memory_report"] = [6, 30_002.0]
    del broken["phases"]["resume-upstream"]
    problems = expectation_problems(broken)
    assert [p.split(":")[1].strip() for p in problems] == [
        "resume-upstream failed or did not run",
        "build",
        "saved checkpoints differ",
        "the build's max allocated after the first resumed iteration (30002.0 MiB) exceeds the uninterrupted training peak (30,000.0 MiB)",
    ]


def test_a_known_upstream_divergence_excuses_upstream_only() -> None:
    """cpu-offload: upstream's resume diverges (the Adam step reset, fixed by patches/0006); the
    check then excuses upstream's loss differences and the differing checkpoints, not the build's.
    """
    assert CONFIGURATIONS["cpu-offload"].upstream_divergence
    assert [n for n, c in CONFIGURATIONS.items() if c.upstream_divergence] == ["cpu-offload"]
    run = _measured_run("KEEPS_LOADER", 16 * 1_000_000_000, None)
    run["loss_differences"]["upstream"] = ["8: 9.9003 != 9.8435"]
    run["checkpoint_differences"] = ["optimizer.state.exp_avg"]
    assert [p.split(":")[1].strip() for p in expectation_problems(run)] == [
        "upstream", "saved checkpoints differ"]  # fmt: skip
    run["configuration"]["upstream_divergence"] = "a known upstream bug"
    assert expectation_problems(run) == []
    run["loss_differences"]["build"] = ["8: 9.9003 != 9.8435"]
    assert [p.split(":")[1].strip() for p in expectation_problems(run)] == ["build"]


def test_a_report_equal_to_the_peak_once_rounded_is_within_it() -> None:
    # The precision-aware build of docs/gpu-results/megatron-lm-small: Megatron printed
    # 3848.91 MiB for a peak of 4,035,873,792 B (3,848.906 MiB); a hundredth more is above it.
    assert within_training_peak(3848.91, 4_035_873_792) is True
    assert within_training_peak(3848.92, 4_035_873_792) is False
    assert within_training_peak(None, 4_035_873_792) is None
    assert within_training_peak(3848.91, None) is None


@pytest.mark.parametrize(
    ("document_path", "missed"),
    [
        ("public-shapes/qwen0.5b/suite.json", set()),
        ("public-shapes/llama-mixtral/suite.json", set()),
        ("public-shapes/qwen1.5b-qwen3b/suite.json", set()),
        ("public-shapes/mixtral-precision-aware/suite.json", set()),
        # not deterministic: both resumes' losses equal each other, not the uninterrupted run's
        ("public-shapes/precision-aware/suite.json", {"llama1b-precision-aware"}),
        ("megatron-lm-small/suite.json", {"llama"}),  # 8.09 at 2.75 x: allocator blocks
        ("llama-style-1b/suite.json", set()),
        ("builtin-llama/suite.json", set()),
        ("builtin-llama/readme-run.json", set()),
    ],
)
def test_the_committed_h200_runs_re_render_and_meet_their_expectations(
    document_path: str, missed: set[str]
) -> None:
    """The committed H200 runs: each report re-renders from its JSON, ``--check``'s verdicts are
    the GPU report's, and every Llama-style run of the build (own arguments included) and every
    public shape's has its load peak at the floor (8 B, precision-aware 6 B, per element within
    0.02 B on the public shapes, else 0.05 B) and its max allocated within the uninterrupted
    run's peak."""
    path = Path(__file__).resolve().parents[2] / "docs/gpu-results" / document_path
    document = json.loads(path.read_text())
    assert markdown_report(document) == path.with_suffix(".md").read_text()
    verdicts = {run["configuration"]["name"]: expectation_problems(run) for run in document["runs"]}
    assert {name for name, problems in verdicts.items() if problems} == missed
    public = document_path.startswith("public-shapes/")
    for run in document["runs"]:
        name = run["configuration"]["name"]
        if public and name in missed:
            differences = run["loss_differences"]
            assert differences["build"] == differences["upstream"], name
        if public or ("llama" in name and name not in missed):
            numbers = run_numbers(run)
            rise, report = numbers.rises["build"], numbers.reports["build"]
            elements, peak = numbers.elements, numbers.training_peak
            assert rise is not None and report is not None and peak is not None and elements
            floor = 6 if "precision-aware" in name else 8
            assert rise <= (floor + (0.02 if public else 0.05)) * elements, name
            assert within_training_peak(report, peak), name
