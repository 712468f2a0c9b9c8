"""The README's "Writing an adopter" block, run as written with a real ``torch.optim.Adam``."""

import pathlib
import re
from typing import Any, Dict, Iterator, List, Optional

import pytest
import torch
from builders import Owner, cloned_state_dict
from outcome_recording import recorded_outcomes

from megatron.core.optimizer.state_adoption import load_inner_optimizer_state_dict

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


class MyAdam(torch.optim.Adam):
    """The optimizer the README's adopter recognises (by its class name)."""


def readme_block() -> str:
    """The first Python block under the README's "Writing an adopter" heading."""
    text = README.read_text()
    assert "## Writing an adopter" in text, "the README has no 'Writing an adopter' section"
    section = text.split("## Writing an adopter", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README's adopter section has no python block"
    return match.group(1)


@pytest.fixture
def readme_adopter() -> Iterator[Dict[str, Any]]:
    """Run the README's block (it registers into the default registry); unregister after."""
    namespace: Dict[str, Any] = {}
    exec(compile(readme_block(), str(README), "exec"), namespace)
    yield namespace
    namespace["handle"].remove()


def trained(cls: type, steps: int = 2) -> torch.optim.Optimizer:
    """A ``cls`` optimizer over two CPU parameters after ``steps`` steps."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(8,), (4, 3)]]
    optimizer: torch.optim.Optimizer = cls(params, lr=0.1)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return optimizer


def load(optimizer: torch.optim.Optimizer, state_dict: Dict[str, Any], owns: bool) -> List[Optional[str]]:
    """Load through the call site; return (adopter, own method, the README adopter's decline)
    of the outcome."""
    with recorded_outcomes() as outcomes:
        load_inner_optimizer_state_dict(Owner(optimizer), state_dict, owns_state_dict=owns)
    (outcome,) = outcomes
    declines = dict(outcome.declines)
    return [outcome.adopter, outcome.method, declines.get("my_adam")]


def test_the_readme_adopter_installs_an_owned_state_dict_by_reference(readme_adopter: Dict[str, Any]) -> None:
    source = cloned_state_dict(trained(MyAdam))
    target = trained(MyAdam, steps=0)
    assert load(target, source, owns=True) == ["my_adam", None, None]
    for index, param in enumerate(p for g in target.param_groups for p in g["params"]):
        assert target.state[param]["exp_avg"] is source["state"][index]["exp_avg"]
    assert target.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize(
    "cls, owns, expected",
    [
        (MyAdam, False, [None, "MyAdam.load_state_dict", "the state dict is the caller's"]),
        (torch.optim.Adam, True, [None, "Adam.load_state_dict", "not MyAdam"]),
    ],
)
def test_the_readme_adopter_declines_what_it_says_it_declines(
    readme_adopter: Dict[str, Any], cls: type, owns: bool, expected: List[Optional[str]]
) -> None:
    source = cloned_state_dict(trained(cls))
    target = trained(cls, steps=0)
    assert load(target, source, owns=owns) == expected
    assert torch.equal(target.state[target.param_groups[0]["params"][0]]["exp_avg"], source["state"][0]["exp_avg"])
