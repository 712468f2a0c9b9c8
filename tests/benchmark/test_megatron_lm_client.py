"""The Megatron-LM client of the resume benchmark: arguments, client tree, parsing, comparison.

Everything the client does before and after the GPU runs, on the CPU: the ``pretrain_gpt.py``
arguments per phase, the refusals, the client tree taken from a real git repository, the
``make`` shim run as a process, Megatron-LM's console lines (in the format of
``megatron/training/training.py`` of core_r0.19.0), real TensorBoard event files written with
``torch.utils.tensorboard``, and real ``torch_dist`` (``torch.distributed.checkpoint``)
directories compared tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.resume_benchmark import megatron_lm as client
from benchmarks.resume_benchmark.report import markdown_report, run_markdown
from benchmarks.resume_benchmark.megatron_lm import ClientUsageError, RunPlan

USER_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--bf16"]


def _plan(tmp_path: Path, deterministic: bool = False) -> RunPlan:
    return RunPlan(10, 4, deterministic, tmp_path / "ckpt")


def test_base_arguments_add_what_the_runs_need_and_say_so() -> None:
    args, notes = client.base_arguments(USER_ARGS, apex_fusion=False)
    assert args[: len(USER_ARGS)] == USER_ARGS
    for added in (
        ["--mock-data"],
        ["--ckpt-format", "torch_dist"],
        ["--eval-iters", "0", "--eval-interval", "1000"],
        ["--no-gradient-accumulation-fusion"],
        ["--log-interval", "1", "--tensorboard-log-interval", "1"],
    ):
        start = args.index(added[0])
        assert args[start : start + len(added)] == added
    assert len(notes) == 4
    assert any("Apex" in note for note in notes)


def test_base_arguments_keep_what_the_user_chose() -> None:
    user = [*USER_ARGS, "--data-path", "/d", "--ckpt-format=torch_dist", "--eval-iters", "3"]
    args, notes = client.base_arguments(user, apex_fusion=True)
    assert "--mock-data" not in args and "--no-gradient-accumulation-fusion" not in args
    assert args.count("--eval-iters") == 1 and "--ckpt-format" not in args[len(user) :]
    assert notes == []
    fused, _ = client.base_arguments([*USER_ARGS, "--no-gradient-accumulation-fusion"], False)
    assert fused.count("--no-gradient-accumulation-fusion") == 1


@pytest.mark.parametrize(
    "extra",
    [["--train-iters", "5"], ["--save=/x"], ["--load", "/x"], ["--exit-interval", "2"],
     ["--log-interval", "10"], ["--deterministic-mode"], ["--no-load-optim"]],
)  # fmt: skip
def test_owned_arguments_are_refused(extra: list[str]) -> None:
    with pytest.raises(ClientUsageError, match=extra[0].split("=")[0]):
        client.base_arguments([*USER_ARGS, *extra], apex_fusion=True)


def test_other_checkpoint_formats_are_refused() -> None:
    with pytest.raises(ClientUsageError, match="torch_dist or fsdp_dtensor"):
        client.base_arguments([*USER_ARGS, "--ckpt-format", "torch"], apex_fusion=True)
    fsdp = [*USER_ARGS, "--use-megatron-fsdp", "--ckpt-format=fsdp_dtensor"]
    args, notes = client.base_arguments(fsdp, apex_fusion=True)
    assert "--ckpt-format" not in args[len(fsdp) :] and not any("ckpt" in n for n in notes)


def test_phase_arguments(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    train = client.phase_arguments(USER_ARGS, "train", plan, tmp_path)
    assert train[-6:] == [
        "--save",
        str(plan.checkpoint),
        "--save-interval",
        "4",
        "--exit-interval",
        "4",
    ]
    assert train[train.index("--train-iters") + 1] == "10"
    control = client.phase_arguments(USER_ARGS, "uninterrupted", plan, tmp_path)
    assert "--save" not in control and "--load" not in control
    assert control[control.index("--tensorboard-dir") + 1] == str(
        tmp_path / "tensorboard-uninterrupted"
    )
    resume = client.phase_arguments(USER_ARGS, "resume-build", plan, tmp_path)
    assert resume[-2:] == ["--load", str(plan.checkpoint)] and "--deterministic-mode" not in resume
    exact = client.phase_arguments(USER_ARGS, "resume-build", _plan(tmp_path, True), tmp_path)
    assert "--deterministic-mode" in exact
    assert exact[-4:] == ["--save", str(tmp_path / "saved-resume-build"), "--save-interval", "10"]


@pytest.mark.parametrize("resume_at", [0, 10, 11])
def test_resume_point_inside_the_run(tmp_path: Path, resume_at: int) -> None:
    with pytest.raises(ClientUsageError, match="--resume-at"):
        RunPlan(10, resume_at, False, tmp_path)


def test_release_of_the_training_code_is_checked(tmp_path: Path) -> None:
    assert client.release_note("0.19", "0.19.2+stateadoption") is None
    note = client.release_note("0.18", "0.19.2+stateadoption")
    assert note and "release 0.18" in note and "core_r0.19.0" in note
    assert "an unknown release" in (client.release_note(None, "0.19.2") or "")
    assert client.tree_release(tmp_path) is None


def test_release_branch() -> None:
    assert client.release_branch("0.19.2+stateadoption") == "core_r0.19.0"
    assert client.release_branch("0.16.1") == "core_r0.16.0"


CONSOLE = """\
 > number of parameters on (tensor, gtp_weight_remat, pipeline) model parallel rank (0, 0, 0): 1073745920
 [2026-12-02 01:02:03.456789] iteration        5/      10 | consumed samples:           80 | elapsed time per iteration (ms): 512.3 | learning rate: 3.000000E-04 | global batch size:    16 | lm loss: 1.034567E+01 | loss scale: 1.0 | grad norm: 2.345 | number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 5 iterations) memory (MB) | allocated: 20480.12 | max allocated: 30720.50 | reserved: 32000.00 | max reserved: 32000.00
 [2026-12-02 01:02:04.456789] iteration        6/      10 | consumed samples:           96 | elapsed time per iteration (ms): 500.1 | learning rate: 2.900000E-04 | global batch size:    16 | lm loss: 1.021000E+01 | loss scale: 1.0 | grad norm: 2.000 | number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 6 iterations) memory (MB) | allocated: 20480.12 | max allocated: 30800.00 | reserved: 32000.00 | max reserved: 32000.00
"""  # fmt: skip


def test_console_parsing() -> None:
    assert client.console_losses(CONSOLE) == {5: "1.034567E+01", 6: "1.021000E+01"}
    assert client.first_memory_report(CONSOLE) == (5, 30720.5)
    assert client.parameter_count(CONSOLE) == 1073745920
    assert client.first_memory_report("no report") is None
    assert client.parameter_count("") is None


def test_tensorboard_losses_are_the_exact_scalars(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    values = {1: 10.123456789, 2: 9.87654321, 3: 9.5}
    writer = SummaryWriter(str(tmp_path))
    for step, value in values.items():
        writer.add_scalar("lm loss", torch.tensor(value), step)
        writer.add_scalar("lm loss vs samples", torch.tensor(value), step * 16)
    writer.close()
    losses = client.tensorboard_losses(tmp_path)
    assert losses == {s: float(torch.tensor(v, dtype=torch.float32)) for s, v in values.items()}
    assert client.tensorboard_losses(tmp_path / "missing") is None


def test_loss_differences() -> None:
    expected = {5: 1.0, 6: 2.0, 7: 3.0}
    assert client.loss_differences(expected, dict(expected), range(5, 8)) == []
    assert client.loss_differences(expected, {5: 1.0, 6: 2.5}, range(5, 8)) == [
        "6: 2.0 != 2.5",
        "7: 3.0 != None",
    ]


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def _megatron_lm_tree(root: Path) -> Path:
    for name in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py", "README.md"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"# {name}\n")
    for name in ("megatron/training/training.py", "megatron/core/__init__.py", "megatron/rl/x.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"# {name}\n")
    (root / "megatron/core/package_info.py").write_text("MAJOR = 0\nMINOR = 19\nPATCH = 1\n")
    return root


def _assert_client_tree(dest: Path) -> None:
    assert (dest / "pretrain_gpt.py").is_file() and (
        dest / "megatron/training/training.py"
    ).is_file()
    assert (dest / "megatron/rl/x.py").is_file()
    assert not (dest / "megatron/core").exists(), "megatron.core must come from the side"
    assert not (dest / "README.md").exists()


def test_client_tree_from_a_git_ref(tmp_path: Path) -> None:
    repo = _megatron_lm_tree(tmp_path / "Megatron-LM")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "m")
    _git(repo, "branch", "core_r0.19.0")
    origin, release = client.prepare_client(
        None, repo / ".git", "core_r0.19.0", tmp_path / "client"
    )
    assert release == "0.19"
    assert origin.startswith(f"{repo / '.git'} core_r0.19.0 (")
    _assert_client_tree(tmp_path / "client")
    with pytest.raises(ClientUsageError, match="no branch, tag or commit core_r9.9.0 in"):
        client.prepare_client(None, repo / ".git", "core_r9.9.0", tmp_path / "other")


def test_client_tree_from_a_checkout(tmp_path: Path) -> None:
    repo = _megatron_lm_tree(tmp_path / "Megatron-LM")
    origin, release = client.prepare_client(repo, None, "unused", tmp_path / "client")
    assert origin.startswith("checkout") and release == "0.19"
    _assert_client_tree(tmp_path / "client")
    with pytest.raises(ClientUsageError, match="no pretrain_gpt.py"):
        client.prepare_client(tmp_path / "client" / "megatron", None, "", tmp_path / "empty")


def test_make_shim_skips_only_a_prebuilt_helpers_directory(tmp_path: Path) -> None:
    bin_dir = client.write_make_shim(tmp_path)
    prebuilt = tmp_path / "datasets"
    prebuilt.mkdir()
    (prebuilt / "helpers_cpp.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    done = subprocess.run([bin_dir / "make", "-C", prebuilt], capture_output=True, text=True)
    assert done.returncode == 0 and "prebuilt helpers_cpp" in done.stdout
    source = tmp_path / "source"
    source.mkdir()
    (source / "helpers_cpp.so").write_bytes(b"")
    (source / "Makefile").write_text("all:\n\t@echo built-by-real-make\n")
    real = subprocess.run([bin_dir / "make", "-C", source], capture_output=True, text=True)
    if client.shutil.which("make"):
        assert real.returncode == 0 and "built-by-real-make" in real.stdout
    else:
        assert real.returncode != 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert subprocess.run([bin_dir / "make", "-C", empty], capture_output=True).returncode != 0


def _save(path: Path, state: dict[str, torch.Tensor]) -> Path:
    from torch.distributed.checkpoint import FileSystemWriter, save

    save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    return path


def test_torch_dist_checkpoints_compared_tensor_by_tensor(tmp_path: Path) -> None:
    state = {
        "model.weight": torch.randn(8, 4),
        "optimizer.exp_avg": torch.randn(32),
        "model.bf16": torch.randn(5).to(torch.bfloat16),
    }
    first = _save(tmp_path / "a", state)
    same = _save(tmp_path / "b", {k: v.clone() for k, v in state.items()})
    equal = client.compare_torch_dist(first, same, batch_bytes=1)
    assert equal.differences == [] and equal.tensors == 3
    assert equal.bytes == (32 + 32) * 4 + 5 * 2
    changed = {k: v.clone() for k, v in state.items()}
    changed["optimizer.exp_avg"][7] = torch.nextafter(
        changed["optimizer.exp_avg"][7], torch.tensor(9.0)
    )
    changed["extra"] = torch.zeros(1)
    other = _save(tmp_path / "c", changed)
    assert client.compare_torch_dist(first, other).differences == ["extra", "optimizer.exp_avg"]


def _document(deterministic: bool) -> dict[str, object]:
    def phase(peak: int | None, report: float, installed: str | None) -> dict[str, object]:
        return {
            "load_peak_over_baseline": peak,
            "first_memory_report": [6, report],
            "installed_by": installed,
            "parameters": 1_000_000_000,
            "max_allocated_bytes": 30 << 30,
        }

    return {
        "megatron_lm": "git core_r0.19.0 (abc)",
        "plan": {"train_iters": 10, "resume_at": 5, "deterministic": deterministic},
        "phases": {
            "uninterrupted": phase(None, 30000.0, None),
            "resume-upstream": phase(16_000_000_000, 40000.0, None),
            "resume-build": phase(8_000_000_000, 30000.0, "te_fused_adam_fp32 ×2"),
        },
        "loss_differences": {"upstream": [], "build": ["7: 1 != 2"]},
        "checkpoint_differences": [] if deterministic else None,
        "checkpoint_compared": {"tensors": 300, "bytes": 1 << 30} if deterministic else None,
        "notes": ["--mock-data added (no data argument given)"],
    }


def test_markdown_report() -> None:
    text = run_markdown(_document(True))
    assert "| upstream | 15,258.8 | 16.00 | 40,000.0 | no | yes | own loader" in text
    assert "| build | 7,629.4 | 8.00 | 30,000.0 | yes | **no** | te_fused_adam_fp32 ×2 |" in text
    assert "identical, tensor by tensor (300 tensors, 1,024.0 MiB compared)" in text
    assert "- --mock-data added" in text
    assert "Checkpoints saved" not in run_markdown(_document(False))
    failed = _document(False)
    del failed["phases"]["resume-build"]  # type: ignore[attr-defined]
    failed["loss_differences"] = {}
    text = run_markdown(failed)
    assert "| build | run failed (see the logs) | n/a" in text
    assert "| upstream | 15,258.8 | 16.00 | 40,000.0 | no | n/a | own loader" in text


def test_the_command_line_refuses_without_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.resume_benchmark.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0 and "pretrain_gpt.py" in capsys.readouterr().out
    if torch.cuda.is_available():
        pytest.skip("the no-CUDA refusal is for machines without a GPU")
    (tmp_path / "pretrain_gpt.py").write_text("")
    assert main(["--megatron-lm", str(tmp_path), "--", *USER_ARGS]) == 2
    assert "cannot run here" in capsys.readouterr().err


def _probe_script(
    tmp_path: Path, checkpointing: str, script: str
) -> tuple[int, dict[str, Any], str]:
    """Run ``script`` under the probe (a subprocess, as each rank runs) with a client tree whose
    ``megatron.training.checkpointing`` is ``checkpointing``; exit code, record and stderr."""
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "__init__.py").write_text("")
    (tmp_path / "megatron" / "training" / "checkpointing.py").write_text(checkpointing)
    (tmp_path / "pretrain_gpt.py").write_text(script)
    code = (
        "import sys\n"
        "from benchmarks.resume_benchmark.megatron_lm_probe import main\n"
        f"sys.exit(main(['--client', {str(tmp_path)!r}, '--result', {str(tmp_path / 'r.json')!r},"
        " 'pretrain_gpt.py']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    record = json.loads((tmp_path / "r.rank0.json").read_text())
    return done.returncode, record, done.stderr


def test_probe_reports_a_run_without_a_load(tmp_path: Path) -> None:
    """The probe on the CPU: a script that never loads leaves ``load`` None, its exit code kept."""
    code, record, stderr = _probe_script(
        tmp_path, "def load_checkpoint():\n    return 0\n", "import sys\nsys.exit(3)\n"
    )
    assert code == 3, stderr
    assert record["load"] is None and record["exit_code"] == 3
    assert record["max_allocated_bytes"] == 0  # no CUDA: torch's statistics are empty
    assert record["modules"]["megatron.training"].startswith(str(tmp_path))


PHASED_LOAD = """
import torch
from megatron.core.dist_checkpointing import serialization
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import FP32Optimizer


def _enter(function, *args):
    # Only the function's start matters here: its PY_START event opens a phase.
    try:
        function(*args)
    except Exception:
        pass


def load_checkpoint():
    _enter(DistributedOptimizer.sharded_state_dict, None, None)  # pass 1 ...
    _enter(DistributedOptimizer.load_state_dict, None, None)  # ... and its scaffold load
    _enter(serialization.load, None, None)  # the read
    torch.nn.Linear(2, 2).load_state_dict(torch.nn.Linear(2, 2).state_dict())  # the model
    _enter(FP32Optimizer.load_state_dict, None, None)  # pass 2
    _enter(DistributedOptimizer.sharded_state_dict, None, None)  # opens nothing more
    return 0
"""


def test_probe_opens_the_load_phases_at_the_real_functions(tmp_path: Path) -> None:
    """The probe's ``sys.monitoring`` events on the real megatron-core and torch functions, in
    Megatron-LM's load order; pass 1's own ``load_state_dict`` opens no phase."""
    from benchmarks.resume_benchmark.megatron_lm_probe import phase_codes
    from benchmarks.resume_benchmark.memory_timeline import LOAD_PHASES

    assert sorted(set(phase_codes().values())) == sorted(LOAD_PHASES)  # all found in the build
    script = "from megatron.training.checkpointing import load_checkpoint\nload_checkpoint()\n"
    code, record, stderr = _probe_script(tmp_path, PHASED_LOAD, script)
    assert code == 0, stderr
    load = record["load"]
    assert [label for label, _ in load["phases"]] == list(LOAD_PHASES)
    seconds = [t for _, t in load["phases"]]
    assert seconds == sorted(seconds) and seconds[-1] <= load["seconds"]


@pytest.mark.parametrize("mode", ["default", "deterministic"])
def test_committed_h200_results_render_unchanged(mode: str) -> None:
    """docs/gpu-results/megatron-lm-1b: the report re-renders from its JSON."""
    results = Path(__file__).resolve().parents[2] / "docs/gpu-results/megatron-lm-1b"
    document = json.loads((results / f"mlm-{mode}.json").read_text())
    assert markdown_report(document) == (results / f"mlm-{mode}.md").read_text()
    build = document["phases"]["resume-build"]
    assert build["installed_by"] == "te_fused_adam_fp32 ×2"
    assert document["loss_differences"] == {"upstream": [], "build": []}


def test_phase_record_takes_the_highest_rank_and_the_exact_losses(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    from benchmarks.resume_benchmark.driver import PhaseOutcome

    log = tmp_path / "resume-build.log"
    log.write_text(CONSOLE)
    writer = SummaryWriter(str(tmp_path / "tb"))
    writer.add_scalar("lm loss", torch.tensor(10.25), 6)
    writer.close()

    def rank(baseline: int, peak: int | None, adopter: str) -> dict[str, object]:
        outcome = {"hook_point": "load", "adopter": adopter}
        return {
            "load": {"baseline_bytes": baseline, "peak_bytes": peak, "peak_before_bytes": 0},
            "max_allocated_bytes": baseline + (peak or 0),
            "state_adoption": {"adopters": [adopter], "outcomes": [outcome]},
        }

    results = (rank(100, 900, "a"), rank(100, 1300, "b"), rank(100, None, "c"), None)
    outcome = PhaseOutcome(0, results, log, 12.34)
    record = client.phase_record("resume-build", "build", outcome, tmp_path / "tb")
    assert record.rank_load_peaks == [800, 1200, None, None]
    assert record.peak_rank == 1 and record.load_peak_over_baseline == 1200
    assert record.installed_by == "b ×1" and record.max_allocated_bytes == 1400
    assert record.losses == {6: 10.25} and record.loss_source == "tensorboard"
    assert record.first_memory_report == (5, 30720.5) and record.parameters == 1073745920
    console = client.phase_record("uninterrupted", "build", outcome, tmp_path / "none")
    assert console.loss_source == "console" and console.losses[5] == "1.034567E+01"
    assert console.installed_by is None
    document = _document(False)
    document["phases"]["resume-build"]["rank_load_peaks"] = [800, 1200]  # type: ignore[index]
    assert "build: load peak over pre-load per rank, MiB: 0.0, 0.0 (the table: the highest)." in (
        run_markdown(document)
    )


FAKE_PRETRAIN_GPT = '''"""Stand-in for Megatron-LM's pretrain_gpt.py (CPU): the console lines, TensorBoard scalars,
exit-interval save and load of the real script, with a loss of 10 / iteration."""
import argparse
import os
import sys

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save
from torch.utils.tensorboard import SummaryWriter

from megatron.training.checkpointing import load_checkpoint

parser = argparse.ArgumentParser()
for flag in ("--train-iters", "--exit-interval", "--save-interval"):
    parser.add_argument(flag, type=int)
for flag in ("--save", "--load", "--tensorboard-dir"):
    parser.add_argument(flag)
args, _ = parser.parse_known_args()
start = load_checkpoint(args.load) if args.load else 0
end = args.exit_interval or args.train_iters
drift = 0.5 if args.load and os.environ.get("FAKE_RESUME_DRIFT") else 0.0
print(" > number of parameters on (tensor, gtp_weight_remat, pipeline) model parallel rank (0, 0, 0): 1000")
writer = SummaryWriter(args.tensorboard_dir)
for iteration in range(start + 1, end + 1):
    loss = 10.0 / iteration + drift
    writer.add_scalar("lm loss", torch.tensor(loss), iteration)
    print(f" [t] iteration {iteration:8d}/{args.train_iters:8d} | lm loss: {loss:.6E} |")
    if iteration == start + 1:
        print(f"[Rank 0] (after {iteration} iterations) memory (MB) | allocated: 1.00 | "
              "max allocated: 2.00 | reserved: 3.00 | max reserved: 3.00")
writer.close()
if args.save and not (args.load and os.environ.get("FAKE_RESUME_SAVES_NOTHING")):
    state = {"weight": torch.full((4,), float(end) + drift)}
    save(state, storage_writer=FileSystemWriter(f"{args.save}/iter_{end:07d}"), no_dist=True)
    with open(f"{args.save}/latest", "w") as latest:
        latest.write(str(end))
sys.exit(0)
'''


def _fake_megatron_lm(root: Path) -> Path:
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\n")
    (root / "megatron" / "training" / "__init__.py").write_text("")
    (root / "megatron" / "training" / "checkpointing.py").write_text(
        "def load_checkpoint(path):\n    with open(path + '/latest') as f:\n        return int(f.read())\n"
    )
    (root / "pretrain_gpt.py").write_text(FAKE_PRETRAIN_GPT)
    return root


def stand_in_megatron_core(site: Path) -> Path:
    """A site whose ``megatron.core`` is an empty package: what the stand-in ``pretrain_gpt.py``
    needs of a side (nothing), without the seconds each rank spends importing the real one.
    The probe then records what it records of upstream (no state adoption, no phase functions);
    its work with the real build is tested in test_the_four_runs_end_to_end and in
    test_benchmark_adoption_records.py."""
    (site / "megatron" / "core").mkdir(parents=True)
    (site / "megatron" / "core" / "__init__.py").write_text('"""Stand-in megatron-core."""\n')
    return site


def _run_fake_client(tmp_path: Path, real_core: bool = False) -> tuple[dict[str, Any], Path]:
    """The client's four runs with the stand-in Megatron-LM; both sides import this
    environment's megatron-core (``real_core``) or :func:`stand_in_megatron_core`."""
    from benchmarks.resume_benchmark.driver import Workspace
    from benchmarks.resume_benchmark.sides import Side

    tree = _fake_megatron_lm(tmp_path / "Megatron-LM")
    workspace = Workspace(tmp_path / "work")
    core = None if real_core else stand_in_megatron_core(tmp_path / "core-site")
    here = Side("build", core, "current environment" if real_core else f"stand-in {core}")
    sides = {"upstream": dataclasses.replace(here, label="upstream"), "build": here}
    setup = client.prepare_setup(
        sides, "0.19.2+stateadoption", (tree, None, None), workspace, 1, 300.0
    )
    plan = RunPlan(4, 2, True, workspace.path("ckpt"))
    document = client.run_client(setup, workspace, plan, USER_ARGS)
    return json.loads(json.dumps(document)), workspace.root


def test_the_four_runs_end_to_end(tmp_path: Path) -> None:
    """The real orchestration, launcher and probe on the CPU, with a stand-in pretrain_gpt.py,
    and this environment's megatron-core (the build) on both sides."""
    document, work = _run_fake_client(tmp_path, real_core=True)
    assert client.failed_phases(document) == []
    phases = document["phases"]
    assert list(phases) == ["train", "uninterrupted", "resume-upstream", "resume-build"]
    assert phases["train"]["losses"] == {"1": 10.0, "2": 5.0}
    assert phases["uninterrupted"]["losses"]["4"] == 2.5
    assert phases["resume-build"]["losses"] == {"3": float(torch.tensor(10 / 3)), "4": 2.5}
    assert all(p["loss_source"] == "tensorboard" and p["exit_code"] == 0 for p in phases.values())
    assert phases["resume-build"]["first_memory_report"] == [3, 2.0]
    assert phases["resume-build"]["load"]["baseline_bytes"] == 0  # no CUDA: statistics are 0
    assert phases["train"]["load"] is None  # the first run loads nothing
    assert phases["resume-build"]["load"]["memory_timeline"] == {
        "error": "RuntimeError: no CUDA device, so no allocator trace to record"
    }
    assert phases["resume-build"]["parameters"] == 1000
    assert document["loss_differences"] == {"upstream": [], "build": []}
    assert document["checkpoint_differences"] == []
    assert document["checkpoint_compared"] == {"tensors": 1, "bytes": 16}
    assert not (work / "ckpt").exists() and not (work / "saved-resume-build").exists()
    assert any("make" in note for note in document["notes"])
    assert not any("WARNING" in note for note in document["notes"])
    training = Path(phases["resume-build"]["modules"]["megatron.training"])
    assert training.is_relative_to(work / "megatron-lm-client"), "the client's training code ran"
    # the probe's outcome hook was on the build's registry: the stand-in loads no optimizer
    assert phases["resume-build"]["outcomes"] == [] and phases["resume-build"]["installed_by"] is None


def test_module_problems_name_code_from_elsewhere(tmp_path: Path) -> None:
    from benchmarks.resume_benchmark.driver import PhaseOutcome
    from benchmarks.resume_benchmark.sides import Side

    log = tmp_path / "x.log"
    log.write_text("")
    result = {"modules": {"megatron.training": "/site/megatron/training/__init__.py",
                          "megatron.core": "/other/megatron/core/__init__.py"}}  # fmt: skip
    record = client.phase_record("resume-build", "build", PhaseOutcome(0, (result,), log, 1.0), log)
    problems = client.module_problems(record, tmp_path / "client", Side("build", Path("/site"), ""))
    assert problems == [
        f"WARNING: resume-build ran megatron.training from /site/megatron/training/__init__.py, "
        f"not {tmp_path / 'client'}",
        "WARNING: resume-build ran megatron.core from /other/megatron/core/__init__.py, not /site",
    ]


def test_the_end_to_end_report_shows_resumed_losses_that_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_RESUME_DRIFT", "1")  # inherited by the runs: resumes drift by 0.5
    document, _ = _run_fake_client(tmp_path)
    assert document["loss_differences"]["build"] == [
        f"3: {float(torch.tensor(10 / 3))} != {float(torch.tensor(10 / 3 + 0.5))}",
        "4: 2.5 != 3.0",
    ]
    assert document["checkpoint_differences"] == []  # both resumes drifted alike
    assert "| build | n/a | n/a | 2.0 | n/a | **no** |" in run_markdown(document)


def test_resumes_that_save_nothing_are_reported_not_compared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_RESUME_SAVES_NOTHING", "1")
    document, _ = _run_fake_client(tmp_path)
    assert document["checkpoint_differences"] is None
    assert "checkpoints not compared: a resume saved none (see its log)" in document["notes"]
    assert "Checkpoints saved" not in run_markdown(document)
