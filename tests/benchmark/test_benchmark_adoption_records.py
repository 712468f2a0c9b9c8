"""What the benchmark records of the state adoption (``results``, through the subsystem's
``default_registry()``): the registered adopters and every outcome with the build, None with
upstream megatron-core (no subsystem), and the opt-in precision-aware plugin -- a distribution
with nothing but its entry point -- loaded when the registry is first consulted, as in a
``precision-aware`` resume of the benchmark with the plugin installed beside the build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

import torch

from benchmarks.resume_benchmark.configs import DEFAULT_ADOPTERS, extra_adopters
from benchmarks.resume_benchmark.results import (
    has_outcome_hooks,
    installed_by_text,
    recording_outcomes,
    registered_adopter_names,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
PLUGIN = REPO_ROOT / "examples" / "te-precision-aware-adopter"
PLUGIN_ADOPTER = "te_fused_adam_precision_aware"


def _adam() -> torch.optim.Adam:
    param = torch.nn.Parameter(torch.ones(4))
    adam = torch.optim.Adam([param])
    param.grad = torch.ones(4)
    adam.step()
    return adam


def test_the_build_reports_its_adopters_and_every_outcome() -> None:
    from megatron.core.optimizer.state_adoption import (
        default_registry,
        load_inner_optimizer_state_dict,
    )

    names = registered_adopter_names()
    assert names == [adopter.name for adopter in default_registry().adopters()]
    assert names is not None and names[: len(DEFAULT_ADOPTERS)] == list(DEFAULT_ADOPTERS)
    assert has_outcome_hooks()
    owner = types.SimpleNamespace(optimizer=_adam())
    with recording_outcomes() as outcomes:
        load_inner_optimizer_state_dict(owner, owner.optimizer.state_dict())
    assert outcomes is not None and len(outcomes) == 1
    (outcome,) = outcomes
    assert outcome["hook_point"] == "load" and outcome["adopter"] is None
    assert outcome["method"] == "Adam.load_state_dict"
    assert installed_by_text({"outcomes": outcomes}) == "own loader ×1"
    # the hook is gone once the block ends
    load_inner_optimizer_state_dict(owner, owner.optimizer.state_dict())
    assert len(outcomes) == 1


def _run(code: str, pythonpath: list[Path]) -> Any:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, pythonpath), str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_upstream_without_the_subsystem_records_nothing(tmp_path: Path) -> None:
    """An upstream-like megatron-core (no ``state_adoption``) first on the path: None, no hook."""
    optimizer = tmp_path / "upstream" / "megatron" / "core" / "optimizer"
    optimizer.mkdir(parents=True)
    for package in (optimizer, optimizer.parent, optimizer.parent.parent):
        (package / "__init__.py").write_text("")
    code = (
        "import json, megatron.core\n"
        "from benchmarks.resume_benchmark.results import *\n"
        "with recording_outcomes() as outcomes:\n"
        "    pass\n"
        "print(json.dumps([registered_adopter_names(), has_outcome_hooks(), outcomes,"
        " megatron.core.__file__]))\n"
    )
    names, hooks, outcomes, core = _run(code, [tmp_path / "upstream"])
    assert (names, hooks, outcomes) == (None, False, None)
    assert core.startswith(str(tmp_path / "upstream"))


def _install_plugin(site: Path) -> None:
    """What ``pip install --no-deps --target SITE`` makes of the plugin's wheel: no module, a
    dist-info whose ``entry_points.txt`` is the pyproject's entry point."""
    project = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]
    dist_info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {value}" for name, value in entries.items())
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")


PLUGIN_CLIENT_CHECKPOINTING = """
def load_checkpoint(optimizer):
    optimizer.load_state_dict(optimizer.state_dict())
    return 0
"""

#: A stand-in pretrain_gpt.py: builds a Megatron-Core optimizer and resumes it, as Megatron-LM
#: does (the load's consultation of the registry loads the plugins).
PLUGIN_SCRIPT = """
import torch
from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.training.checkpointing import load_checkpoint


class CpuFP32Optimizer(FP32Optimizer):
    def __init__(self, optimizer, config):
        MegatronOptimizer.__init__(self, optimizer, config, None)  # MCore's own constructor


param = torch.nn.Parameter(torch.ones(4))
adam = torch.optim.Adam([param])
param.grad = torch.ones(4)
adam.step()
load_checkpoint(CpuFP32Optimizer(adam, OptimizerConfig()))
"""


def test_the_precision_aware_plugin_is_only_an_entry_point_the_probe_reports(
    tmp_path: Path,
) -> None:
    """The plugin beside the build (``pip install --target`` of both, as for ``--build DIR``):
    the probe of a run whose optimizer Megatron-Core constructs and loads records the plugin's
    adopter after the built-in ones, and the report names it as an extra adopter."""
    site = tmp_path / "plugin-site"
    _install_plugin(site)
    client = tmp_path / "client"
    (client / "megatron" / "training").mkdir(parents=True)
    (client / "megatron" / "training" / "__init__.py").write_text("")
    (client / "megatron" / "training" / "checkpointing.py").write_text(PLUGIN_CLIENT_CHECKPOINTING)
    (client / "pretrain_gpt.py").write_text(PLUGIN_SCRIPT)
    result = tmp_path / "r.json"
    code = (
        "import json\n"
        "from benchmarks.resume_benchmark.megatron_lm_probe import main\n"
        f"code = main(['--client', {str(client)!r}, '--result', {str(result)!r}, 'pretrain_gpt.py'])\n"
        "print(json.dumps(code))\n"
    )
    assert _run(code, [site]) == 0
    adoption = json.loads((tmp_path / "r.rank0.json").read_text())["state_adoption"]
    assert adoption["adopters"] == [*DEFAULT_ADOPTERS, PLUGIN_ADOPTER]
    (outcome,) = adoption["outcomes"]
    assert outcome["hook_point"] == "load" and outcome["adopter"] is None  # torch's Adam: no TE
    assert [name for name, _ in outcome["declines"]] == [*DEFAULT_ADOPTERS, PLUGIN_ADOPTER]
    assert extra_adopters(adoption["adopters"]) == (PLUGIN_ADOPTER,)

