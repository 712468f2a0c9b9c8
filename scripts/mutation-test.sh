#!/usr/bin/env bash
# Mutation testing of megatron/core/optimizer/state_adoption with mutmut.
#
#   bash scripts/mutation-test.sh [--diffs] [mutant name glob ...]
#
# Installs this repository's composed megatron-core wheel, the example plugin, pytest and
# mutmut (pinned in requirements/mutation.txt) into a venv: $VENV if set (reused as it is
# if it already has mutmut), else build/mutation-venv. mutmut (configured in
# pyproject.toml, [tool.mutmut]) writes the mutated copy of the subsystem to mutants/ and
# runs the CPU tests there; the tests import the *installed* megatron-core, so for the
# duration of the run the installed state_adoption package is replaced by a symlink to
# mutants/megatron/core/optimizer/state_adoption (restored on exit, also on failure).
# mutmut's own forced-fail check (every mutated function raising) must fail the tests
# before any mutant is run, which proves the tests exercise the mutated copy.
# Prints the per-file counts and every mutant not killed (with --diffs: its diff).
# A fresh run (mutants/ removed first) takes 9-12 minutes on 2 cores, plus the install.
# KEEP_MUTANTS=1 keeps mutants/ and lets mutmut resume or re-check only changed functions.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/find-python.sh

diffs=()
if [[ ${1:-} == --diffs ]]; then diffs=(--diffs); shift; fi

venv=${VENV:-build/mutation-venv}
if [[ ! -x $venv/bin/mutmut ]]; then
  find_python
  echo "== venv $venv ($("$PYTHON" --version))"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  echo "== install: pip install . ./examples/te-precision-aware-adopter -r requirements/mutation.txt"
  "$venv/bin/python" -m pip install -q . ./examples/te-precision-aware-adopter -r requirements/mutation.txt
fi
version() { "$venv/bin/python" -m pip show "$1" | sed -n 's/^Version: //p'; }
echo "== mutmut $(version mutmut), megatron-core $(version megatron-core), $("$venv/bin/python" --version)"

installed=$("$venv/bin/python" -W ignore -c 'import pathlib, megatron.core.optimizer as m; print(pathlib.Path(m.__file__).parent / "state_adoption")' 2>/dev/null)
aside="$installed.installed"
restore() {
  if [[ -L $installed ]]; then rm "$installed"; fi
  if [[ -d $aside && ! -e $installed ]]; then mv "$aside" "$installed"; fi
}
trap restore EXIT
if [[ ! -L $installed ]]; then mv "$installed" "$aside"; fi
ln -sfn "$PWD/mutants/megatron/core/optimizer/state_adoption" "$installed"

if [[ ${KEEP_MUTANTS:-0} != 1 ]]; then rm -rf mutants; fi
echo "== mutmut run (started $(date -u +%FT%TZ))"
start=$SECONDS
# mutmut redraws a progress line many times a second; those lines are dropped (the summary follows).
set +e
PATH="$PWD/$venv/bin:$PATH" "$venv/bin/mutmut" run "$@" | tr '\r' '\n' | grep -v '^[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏]'
status=${PIPESTATUS[0]}
set -e
if [[ $status != 0 ]]; then echo "mutmut run failed (exit $status)" >&2; exit "$status"; fi
echo "== mutmut run took $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
"$venv/bin/python" scripts/mutation_summary.py "${diffs[@]}"
