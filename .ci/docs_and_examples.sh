#!/usr/bin/env bash
# Build the API reference and user guide with warnings as errors, then run every example on a
# tiny input.  Usage:
#     bash .ci/docs_and_examples.sh [PYTHON]
# PYTHON (default: the active environment's python) must have mxload installed with the docs
# and examples extras: pip install ".[docs,examples]" (the wheel: "$wheel[docs,examples]").
# Run from anywhere; it reads docs/ and examples/ of this checkout and writes only to a
# temporary folder, removed on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-python}
out=$(mktemp -d "${TMPDIR:-/tmp}/mxload-docs.XXXXXX")
trap 'rm -rf "$out"' EXIT
step() { printf '\n--- %s\n' "$*"; }

(cd "$out" && "$python" - <<'PY'
import importlib.util, sys
missing = [m for m in ("mxload", "sphinx", "torch", "PIL") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing {', '.join(missing)}: pip install '.[docs,examples]' into {sys.executable}")
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

# Each example on a tiny input, bounded in time; from a scratch folder so nothing is written here.
run_example() {
    step "examples/$*"
    (cd "$out" && timeout 300 "$python" "$OLDPWD/examples/$@")
}
run_example image_folder.py --make-data --epochs 2 --workers 2
run_example text_pad.py --workers 2
run_example profile_my_dataset.py --workers 2 --batches 6
run_example torch_train.py --epochs 2 --workers 2 --samples 1024
step "docs and examples passed"
