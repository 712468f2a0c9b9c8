"""The README's opening: what a newcomer reads first (the problem, the number, the guarantee, a
figure, the current results, the two commands), checked against the repository."""

import re
from pathlib import Path

from benchmarks.resume_benchmark.configs import CONFIGURATIONS

REPO = Path(__file__).resolve().parents[1]
LINES = (REPO / "README.md").read_text().splitlines()


def test_the_first_three_lines_of_text_state_the_problem_the_number_and_the_guarantee() -> None:
    problem, number, guarantee = [line for line in LINES[1:8] if line.strip()][:3]
    assert "8 extra bytes" in problem and "per parameter" in problem and "FusedAdam" in problem
    assert re.search(r"\d+\.\d\d instead of \d+\.\d\d bytes/parameter", number), number
    assert "bitwise" in guarantee


def test_one_figure_of_a_resume_follows_and_it_exists() -> None:
    figures = [re.search(r"!\[[^\]]+\]\(([^)]+)\)", line) for line in LINES[:10]]
    (path,) = [match.group(1) for match in figures if match]
    assert (REPO / path).is_file() and path.endswith(".png")


def test_a_table_of_current_results_names_every_mode_it_shows_by_its_configuration() -> None:
    rows = [line for line in LINES[:25] if line.startswith("| `")]
    names = [re.match(r"\| `([\w-]+)`", row).group(1) for row in rows]  # type: ignore[union-attr]
    assert len(names) >= 8 and set(names) <= set(CONFIGURATIONS), names


def test_the_two_commands_are_the_benchmark_and_what_ci_runs_with_their_timings() -> None:
    block = "\n".join(LINES[:30])
    assert "bash scripts/run-benchmark.sh" in block and "bash scripts/run-tests.sh" in block
    assert "exec bash scripts/run-tests.sh" in (REPO / ".ci/run").read_text()
    test_line = next(line for line in LINES[:30] if line.startswith("bash scripts/run-tests.sh"))
    assert re.search(r"\d+ min", test_line) and re.search(r"\d+ passed", test_line), test_line
