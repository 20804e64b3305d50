#!/usr/bin/env bash
# Build the API reference and user guide with warnings as errors, against an installed mxload.
# Usage:
#     bash .ci/docs.sh [PYTHON]
# PYTHON (default: the active environment's python) must have mxload installed with the docs
# extra: pip install ".[docs]" (the wheel: "$wheel[docs]").  Run from anywhere; it reads docs/
# of this checkout and writes only to a temporary folder, removed on exit.  (The examples run
# in the test suite's e2e tier: tests/test_examples.py, tests/test_torch_train_example.py.)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-python}
out=$(mktemp -d "${TMPDIR:-/tmp}/mxload-docs.XXXXXX")
trap 'rm -rf "$out"' EXIT
step() { printf '\n--- %s\n' "$*"; }

(cd "$out" && "$python" - <<'PY'
import importlib.util, sys
missing = [m for m in ("mxload", "sphinx", "myst_parser") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing {', '.join(missing)}: pip install '.[docs]' into {sys.executable}")
import mxload._core  # the installed package, with its compiled core
PY
)

step "sphinx -W: the API reference (autodoc + napoleon) and the user guide"
# -W: any warning (a broken docstring, a missing reference target, a bad directive) fails the build.
# -n is not used: type names in docstrings (int | None, callable) are prose, not link targets.
# From the scratch folder: run from the checkout, `import mxload` would find the source tree
# (no compiled core) before the installed package.
(cd "$out" && "$python" -m sphinx -W --keep-going -q -b html "$OLDPWD/docs" "$out/html")
test -s "$out/html/api.html" && test -s "$out/html/guide.html"

step "docs passed"
