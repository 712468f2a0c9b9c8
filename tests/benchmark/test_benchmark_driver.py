"""How the resume benchmark launches a run, on the CPU: real ``torch.distributed.run`` launches
of the probe through the driver (one result per rank; a rank that leaves none is named with its
own log tail), the side probe, the launch environment, and SIGTERM to the driver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.resume_benchmark.driver import (
    RANK_LINE_PREFIX,
    PhaseOutcome,
    Workspace,
    failure_tail,
    rank_result_path,
    report_failure,
    run_phase,
)
from benchmarks.resume_benchmark.sides import DETERMINISM_ENV, Side, worker_environment

THIS_VENV = Side("build", None, "this venv")


def _script(directory: Path, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "script.py").write_text(body)
    return directory


def _launch(tmp_path: Path, body: str, nproc: int, timeout: float = 300.0) -> PhaseOutcome:
    client = _script(tmp_path / "client", body)
    workspace = Workspace(tmp_path / "work")
    result = workspace.path("run.result.json")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--tee", "3", "--nproc-per-node",
        str(nproc), "-m", "benchmarks.resume_benchmark.megatron_lm_probe", "--client",
        str(client), "--result", str(result), "script.py",
    ]  # fmt: skip
    return run_phase(workspace, THIS_VENV, "run", command, timeout, nproc)


def test_rank_result_path_and_prefixes() -> None:
    assert rank_result_path(Path("/w/a.result.json"), 3) == Path("/w/a.result.rank3.json")
    assert RANK_LINE_PREFIX.match("[rank1]: x")[1] == "1"  # type: ignore[index]
    assert RANK_LINE_PREFIX.match("[default0]:x")[1] == "0"  # type: ignore[index]
    assert RANK_LINE_PREFIX.match("rank1: x") is None


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_launch_writes_one_result_per_rank(tmp_path: Path, nproc: int) -> None:
    outcome = _launch(tmp_path, "print('hello from the script')\n", nproc)
    assert outcome.ok, outcome.log.read_text()
    results = [r or {} for r in outcome.results]
    assert len(results) == nproc and all(r["exit_code"] == 0 for r in results)
    assert all(r["load"] is None for r in results)  # the script loads no checkpoint
    log = outcome.log.read_text()
    assert "hello from the script" in log and "torch.distributed.run" in log.splitlines()[1]


def test_a_rank_without_a_result_is_named_with_its_log_tail(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = "import os\nif os.environ['RANK'] == '1':\n    raise RuntimeError('rank one broke')\n"
    outcome = _launch(tmp_path, body, 2)
    assert outcome.returncode != 0 and not outcome.ok
    assert [r is None for r in outcome.results] == [False, True]
    report_failure(outcome, "run")
    out = capsys.readouterr().out
    assert "run FAILED" in out and "ranks without a result: 1" in out
    assert "--- rank 1:" in out and "rank one broke" in out


def test_the_side_probe_records_what_the_side_imports(tmp_path: Path) -> None:
    workspace = Workspace(tmp_path / "work")
    result = workspace.path("probe.result.json")
    command = [sys.executable, "-m", "benchmarks.resume_benchmark.side_probe", "--result"]
    outcome = run_phase(workspace, THIS_VENV, "probe", [*command, str(result)], 300.0)
    assert outcome.ok, outcome.log.read_text()
    probe = outcome.results[0]
    assert probe is not None and probe["cuda_available"] is False  # this machine
    assert probe["megatron_core"]["has_state_adoption"] and probe["megatron_core"]["error"] is None
    assert probe["megatron_core"]["version"].endswith("+stateadoption")
    assert probe["transformer_engine"]["error"]  # not installed here: recorded, not raised


def test_failure_tail_keeps_every_rank_in_view() -> None:
    lines = [f"[rank0]: noise {i}" for i in range(100)] + ["[rank1]: Traceback: boom"]
    lines += ["torchrun: ChildFailedError"]
    tail = failure_tail("\n".join(lines), lines=3)
    assert tail == ["torchrun: ChildFailedError", "--- rank 0:", "[rank0]: noise 97",
                    "[rank0]: noise 98", "[rank0]: noise 99", "--- rank 1:",
                    "[rank1]: Traceback: boom"]  # fmt: skip
    assert failure_tail("a\nb\nc", lines=2) == ["b", "c"]


def test_launches_get_the_gpus_but_not_a_launchers_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in (("CUDA_VISIBLE_DEVICES", "2,3"), ("RANK", "5"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", "/repo:/other")
    env = worker_environment(Side("build", Path("/site"), "x"), Path("/repo"))
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and "RANK" not in env and "MASTER_PORT" not in env
    assert env["PYTHONPATH"] == "/site:/other"  # the repository's megatron/ never shadows a side
    assert {k: env[k] for k in DETERMINISM_ENV} == dict(DETERMINISM_ENV)


def test_sigterm_to_the_driver_kills_the_running_launch(tmp_path: Path) -> None:
    """``timeout`` signals only the driver: the launch it started in its own session must not
    outlive it (orphaned ranks would hold GPUs into the next device call)."""
    client = _script(tmp_path / "client", "import time\ntime.sleep(30)\n")
    result = tmp_path / "p.result.json"
    script = (
        "import signal, sys\n"
        "from pathlib import Path\n"
        "from benchmarks.resume_benchmark import cli\n"
        "from benchmarks.resume_benchmark.driver import Workspace, run_phase\n"
        "from benchmarks.resume_benchmark.sides import Side\n"
        "signal.signal(signal.SIGTERM, cli.exit_on_sigterm)\n"
        f"command = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--tee', '3', "
        f"'--nproc-per-node', '2', '-m', 'benchmarks.resume_benchmark.megatron_lm_probe', "
        f"'--client', {str(client)!r}, '--result', {str(result)!r}, 'script.py']\n"
        f"run_phase(Workspace(Path({str(tmp_path)!r})), Side('build', None, 't'), 'p', command, 300.0, 2)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=repo)
    deadline = time.monotonic() + 60
    launched: list[str] = []
    while time.monotonic() < deadline and len(launched) < 3:  # the launcher and its two ranks
        time.sleep(0.5)
        found = subprocess.run(["pgrep", "-f", str(result)], capture_output=True, text=True)
        launched = found.stdout.split()
    assert len(launched) >= 3, "the launch did not start"
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=60) == 128 + signal.SIGTERM
    give_up = time.monotonic() + 10.0
    survivors = [int(p) for p in launched if _alive(int(p))]
    while survivors and time.monotonic() < give_up:
        time.sleep(0.1)
        survivors = [p for p in survivors if _alive(p)]
    assert survivors == [], f"processes outlived the driver: {survivors}"
    assert os.path.exists(tmp_path / "p.log")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
