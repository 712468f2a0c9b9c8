"""How the resume benchmark launches its phases, on the CPU.

Covers the phase command on one rank (a plain worker process) and on several
(``torch.distributed.run``, every console line prefixed with its rank), real launches of the
worker through the driver (the probe phase on one and on two ranks; a train phase that fails on
every rank, as it does without CUDA, with its per-rank errors and log tails), the validation of
the process-layout flags and the refusal of formats that cannot be resumed at another
data-parallel size.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.resume_benchmark import cli
from benchmarks.resume_benchmark.cases import (
    CASE_NAMES,
    PRESETS,
    SHARDING_FORMATS,
    BenchmarkCase,
    make_case,
)
from benchmarks.resume_benchmark.driver import Workspace, failure_tail, report_failure, run_phase
from benchmarks.resume_benchmark.launch import (
    DP_RESHARDABLE_FORMATS,
    LayoutError,
    ParallelLayout,
    rank_result_path,
    refuse_dp_resharding,
    validate_layout,
    worker_command,
)
from benchmarks.resume_benchmark.sides import Side, worker_environment

TINY = PRESETS["tiny"]


# --------------------------------------------------------------------------- commands


def test_single_rank_command_is_the_plain_worker_command() -> None:
    command = worker_command("/py", "train", Path("/w/c.result.json"), Path("/w/c.spec.json"), 1)
    assert command == [
        "/py",
        "-m",
        "benchmarks.resume_benchmark.worker",
        "--phase",
        "train",
        "--result",
        "/w/c.result.json",
        "--spec",
        "/w/c.spec.json",
    ]
    probe = worker_command("/py", "probe", Path("/w/p.result.json"), None)
    assert probe == ["/py", "-m", "benchmarks.resume_benchmark.worker", "--phase", "probe",
                     "--result", "/w/p.result.json"]  # fmt: skip


def test_multi_rank_command_goes_through_torchrun() -> None:
    command = worker_command("/py", "resume", Path("/w/r.result.json"), Path("/w/r.spec.json"), 4)
    assert command[:9] == [
        "/py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "--tee",
        "3",
        "-m",
    ]
    assert command[9:] == [
        "benchmarks.resume_benchmark.worker",
        "--phase",
        "resume",
        "--result",
        "/w/r.result.json",
        "--spec",
        "/w/r.spec.json",
    ]


def test_torchrun_accepts_the_launcher_flags() -> None:
    """The installed torch's launcher parses exactly the flags the command uses."""
    from torch.distributed.run import get_args_parser

    command = worker_command(sys.executable, "train", Path("r.json"), Path("s.json"), 2)
    parsed = get_args_parser().parse_args(command[3:])
    assert parsed.standalone and parsed.module and parsed.nproc_per_node == "2"
    assert parsed.tee == "3" and not parsed.log_line_prefix_template  # given in the environment
    assert parsed.training_script == "benchmarks.resume_benchmark.worker"
    assert parsed.training_script_args == ["--phase", "train", "--result", "r.json",
                                           "--spec", "s.json"]  # fmt: skip


def test_rank_prefixes_are_recognised_in_either_form() -> None:
    """Ours, set through TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, and torch's default."""
    from benchmarks.resume_benchmark.launch import RANK_LINE_PREFIX, RANK_LINE_PREFIX_ENV

    template = RANK_LINE_PREFIX_ENV["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"]
    assert RANK_LINE_PREFIX.match(template.replace("${rank}", "3") + "x")[1] == "3"  # type: ignore[index]
    assert RANK_LINE_PREFIX.match("[default1]:Traceback")[1] == "1"  # type: ignore[index]
    assert RANK_LINE_PREFIX.match("[W1129 20:20:53] warning") is None


def test_a_phase_needs_a_rank() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        worker_command("/py", "train", Path("r.json"), None, 0)


def test_rank_result_path() -> None:
    assert rank_result_path(Path("/w/moe.control.result.json"), 3) == Path(
        "/w/moe.control.result.rank3.json"
    )


def test_phase_nproc_and_single_rank_default() -> None:
    layout = ParallelLayout(8, 1, 1, 4)
    assert layout.phase_nproc("train") == 8 and layout.phase_nproc("resume") == 4
    assert layout.resharded and not layout.single_rank and layout.gpus_needed == 8
    assert ParallelLayout().single_rank and not ParallelLayout().resharded
    assert ParallelLayout.from_json(layout.to_json()) == layout
    assert layout.to_json()["data_parallel_size"] == 8
    assert ParallelLayout(4, 2, 1, 4).to_json()["data_parallel_size"] == 2


# --------------------------------------------------------------------------- validation


def _cases(*names: str, **kwargs: Any) -> list[BenchmarkCase]:
    return [make_case(n, TINY, **kwargs) for n in names]


def test_default_flags_give_the_single_rank_layout() -> None:
    layout = validate_layout(1, 1, 1, None, _cases(*CASE_NAMES), TINY)
    assert layout == ParallelLayout() and layout.single_rank


def test_valid_multi_rank_layouts() -> None:
    assert validate_layout(2, 1, 1, None, _cases("dp_reshardable"), TINY).resume_nproc_per_node == 2
    assert not validate_layout(4, 2, 1, None, _cases("fully_reshardable"), TINY).single_rank
    assert validate_layout(2, 1, 2, None, _cases("moe"), TINY).expert_model_parallel_size == 2
    for fmt in sorted(DP_RESHARDABLE_FORMATS):
        assert validate_layout(2, 1, 1, 4, _cases(fmt), TINY).resharded


@pytest.mark.parametrize(
    ("nproc", "tp", "ep", "resume", "names", "message"),
    [
        (3, 2, 1, None, ("dp_reshardable",), "--nproc-per-node 3 is not divisible by --tensor"),
        (2, 1, 4, None, ("moe",), "not divisible by TP x EP = 1 x 4"),
        (4, 2, 2, 2, ("moe",), "--resume-nproc-per-node 2 is not divisible by TP x EP"),
        (4, 2, 1, 3, ("dp_reshardable",), "--resume-nproc-per-node 3 is not divisible"),
        (0, 1, 1, None, ("dp_reshardable",), "must be at least 1"),
        (2, 0, 1, None, ("dp_reshardable",), "must be at least 1"),
        (8, 8, 1, None, ("dp_reshardable",), "--num-attention-heads 4 is not divisible"),
        (2, 1, 2, None, ("dp_reshardable", "moe"), "applies to the moe case only"),
        (8, 1, 8, None, ("moe",), "--num-experts 4 is not divisible by --expert-model"),
        (2, 1, 1, 4, ("fully_sharded_model_space",), "cannot be resumed at another"),
    ],
)
def test_invalid_layouts_are_refused(
    nproc: int, tp: int, ep: int, resume: int | None, names: tuple[str, ...], message: str
) -> None:
    with pytest.raises(LayoutError, match=message.replace("(", r"\(")):
        validate_layout(nproc, tp, ep, resume, _cases(*names), TINY)


def test_fold_experts_with_expert_parallelism_is_refused() -> None:
    with pytest.raises(LayoutError, match="--moe-fold-experts"):
        validate_layout(2, 1, 2, None, _cases("moe", moe_fold_experts=True), TINY)


def test_resharding_refusal_names_the_format_and_the_alternatives() -> None:
    with pytest.raises(LayoutError) as info:
        refuse_dp_resharding("fully_sharded_model_space", "fully_sharded_model_space")
    text = str(info.value)
    assert "flattened_range" in text
    for fmt in DP_RESHARDABLE_FORMATS:
        assert fmt in text
    for fmt in DP_RESHARDABLE_FORMATS:
        refuse_dp_resharding(fmt, fmt)  # does not raise
    assert set(SHARDING_FORMATS) - DP_RESHARDABLE_FORMATS == {"fully_sharded_model_space"}


def test_fully_reshardable_is_what_megatron_core_calls_fully_reshardable() -> None:
    """The classification leans on MCore 0.19.2's own list of fully reshardable formats."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    fully = set(DistributedOptimizer.checkpoint_fully_reshardable_formats)
    assert "fully_reshardable" in fully and "dp_reshardable" not in fully
    assert "dp_zero_gather_scatter" not in fully


def test_cli_reports_an_invalid_layout_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--preset", "tiny", "--nproc-per-node", "3", "--tensor-model-parallel-size", "2"])
    assert info.value.code == 2
    assert "--nproc-per-node 3 is not divisible" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["--preset", "tiny", "--nproc-per-node", "2", "--resume-nproc-per-node", "4",
                  "--cases", "fully_sharded_model_space"])  # fmt: skip
    assert info.value.code == 2
    assert "cannot be resumed at another data-parallel size" in capsys.readouterr().err


def test_cli_parses_the_layout_flags() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["--preset", "tiny", "--cases", "moe", "--nproc-per-node", "4",
                              "--expert-model-parallel-size", "2",
                              "--resume-nproc-per-node", "2"])  # fmt: skip
    layout = cli.parse_layout(parser, args, cli.model_size(args))
    assert layout == ParallelLayout(4, 1, 2, 2)
    defaults = parser.parse_args([])
    assert cli.parse_layout(parser, defaults, cli.model_size(defaults)) == ParallelLayout()


def test_the_opt_in_precision_aware_cases_run_only_by_name() -> None:
    parser = cli.build_parser()
    assert "precision_aware_fp16" not in parser.parse_args([]).cases
    assert "precision_aware_fp16" not in parser.parse_args(["--cases", "all"]).cases
    args = parser.parse_args(["--cases", "precision_aware_fp16,precision_aware_bf16_fully_reshardable"])
    fp16, fully = cli.make_cases(args, TINY)
    assert (fp16.sharding_format, fp16.moment_dtype, fp16.param_remainders) == ("dp_reshardable", "float16", True)
    # megatron-core 0.19.2 cannot resume the gathered formats with int16 master remainders
    assert (fully.sharding_format, fully.moment_dtype, fully.param_remainders) == ("fully_reshardable", "bfloat16", False)
    assert fp16.precision_aware and fully.precision_aware
    with pytest.raises(SystemExit):
        parser.parse_args(["--cases", "precision_aware_bf16_fully"])


# --------------------------------------------------------------------------- real launches


def _probe(tmp_path: Path, nproc: int) -> Any:
    workspace = Workspace(tmp_path / "work")
    return run_phase(workspace, Side("build", None, "this venv"), "probe", "probe", None, 300.0, nproc)


@pytest.mark.parametrize("nproc", [1, 2])
def test_real_launch_writes_one_result_per_rank(tmp_path: Path, nproc: int) -> None:
    outcome = _probe(tmp_path, nproc)
    assert outcome.returncode == 0 and outcome.ok, outcome.log.read_text()
    assert len(outcome.results) == nproc
    for result in outcome.results:
        assert result is not None and result["megatron_core"]["has_state_adoption"]
        assert result["cuda_available"] is False  # this machine
    log = outcome.log.read_text()
    assert ("torch.distributed.run" in log.splitlines()[1]) == (nproc > 1)


def test_real_launch_that_fails_on_every_rank_is_reported_per_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without CUDA the train phase fails on each rank: every rank records its error, the
    launcher exits non-zero, and the failure report shows each rank's own log tail."""
    workspace = Workspace(tmp_path / "work")
    case = make_case("dp_reshardable", TINY)
    spec = {"case": case.to_json(), "checkpoint_dir": str(tmp_path / "ckpt"), "side": "control",
            "parallel": ParallelLayout(2, 1, 1, 2).to_json()}  # fmt: skip
    side = Side("build", None, "this venv")
    outcome = run_phase(workspace, side, "train", "dp.control", spec, 300.0, 2)
    assert outcome.returncode != 0 and not outcome.ok
    assert [sorted(r) for r in outcome.results if r is not None] == [
        ["case", "error", "phase", "side"]
    ] * 2
    errors = outcome.results_or_errors()
    assert all(e["error"] for e in errors)
    report_failure(outcome, "dp.control")
    out = capsys.readouterr().out
    assert "dp.control FAILED" in out and "ranks reporting an error: 0, 1" in out
    assert "--- rank 0:" in out and "--- rank 1:" in out


def test_failure_tail_keeps_every_rank_in_view() -> None:
    lines = [f"[rank0]: noise {i}" for i in range(100)] + ["[rank1]: Traceback: boom"]
    lines += ["torchrun: ChildFailedError"]
    tail = failure_tail("\n".join(lines), lines=3)
    assert tail == ["torchrun: ChildFailedError", "--- rank 0:", "[rank0]: noise 97",
                    "[rank0]: noise 98", "[rank0]: noise 99", "--- rank 1:",
                    "[rank1]: Traceback: boom"]  # fmt: skip
    assert failure_tail("a\nb\nc", lines=2) == ["b", "c"]


def test_workers_get_the_gpus_but_not_a_launchers_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in (("CUDA_VISIBLE_DEVICES", "2,3"), ("RANK", "5"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)
    env = worker_environment(Side("build", Path("/site"), "x"), Path("/repo"))
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and "RANK" not in env and "MASTER_PORT" not in env
    assert env["PYTHONPATH"].split(":")[0] == "/site"


def test_cli_gpus_flag() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["--gpus", "2, 3"]).gpus == "2,3"
    for bad in ("a", "1,1", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["--gpus", bad])


def test_sigterm_to_the_driver_kills_the_running_launch(tmp_path: Path) -> None:
    """``timeout`` signals only the driver: the launch it started in its own session must not
    outlive it (orphaned ranks would hold GPUs into the next device call)."""
    import os
    import signal
    import subprocess
    import time

    repo = Path(__file__).resolve().parents[1]
    script = (
        "import signal, sys\n"
        "from pathlib import Path\n"
        "from benchmarks.resume_benchmark import cli\n"
        "from benchmarks.resume_benchmark.driver import Workspace, run_phase\n"
        "from benchmarks.resume_benchmark.sides import Side\n"
        "signal.signal(signal.SIGTERM, cli.exit_on_sigterm)\n"
        f"run_phase(Workspace(Path({str(tmp_path)!r})), Side('build', None, 't'), 'probe', 'p', None, 300.0, 2)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=repo)
    log = tmp_path / "p.log"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "torch.distributed.run" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    time.sleep(1.0)  # the launcher has started its ranks
    launched = subprocess.run(["pgrep", "-f", str(tmp_path / "p.result.json")], capture_output=True, text=True)
    assert launched.stdout.split(), "the launch did not start"
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=60) == 128 + signal.SIGTERM
    # The killed ranks may take a moment to be reaped on a loaded machine; left alone they would
    # run for about 7 s more, so a few seconds of polling cannot mistake an exit for a kill.
    give_up = time.monotonic() + 4.0
    survivors = [int(p) for p in launched.stdout.split() if _alive(int(p))]
    while survivors and time.monotonic() < give_up:
        time.sleep(0.1)
        survivors = [p for p in survivors if _alive(p)]
    assert survivors == [], f"processes outlived the driver: {survivors}"
    assert os.path.exists(log)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
