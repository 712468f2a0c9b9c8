# Sourced by the scripts in this folder: sets PYTHON to an interpreter >= 3.12.
# Order: $PYTHON if set, python3 on PATH (the current interpreter: an activated venv, uv or conda
# environment), python3.12 / python3.13 on PATH, then pyenv's 3.12/3.13.
_is_py312_plus() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
find_python() {
  local candidate
  for candidate in ${PYTHON:-} python3 python3.12 python3.13; do
    if command -v "$candidate" >/dev/null 2>&1 && _is_py312_plus "$candidate"; then
      PYTHON=$(command -v "$candidate"); return 0
    fi
  done
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[23]*/bin/python3; do
    if [[ -x $candidate ]] && _is_py312_plus "$candidate"; then PYTHON=$candidate; return 0; fi
  done
  echo "error: this megatron-core build needs Python >= 3.12 and none was found (set PYTHON=...)" >&2
  return 1
}
