#!/usr/bin/env bash
# `make test` on the lowest transformers that setup.py accepts, in place of .venv's (the newest in range), so that
# both ends of the range are tested as far as a CPU can; the GPU machines lent to this project run an older one
# than .venv (transformers 5.17.0 there, 5.19 here: benchmarks/results/history/2026-11-28-gpu-image-versions-on-cpu.md).
#
#   scripts/test_transformers_lower_end.sh [pytest args]     e.g. -x -k packing
#   TRANSFORMERS=5.17.0 scripts/test_transformers_lower_end.sh   another version
#   make test-transformers-lower-end
#
# transformers goes into .venv/transformers-<version>/ (once; --no-deps), with the newest huggingface_hub its own
# requirements table admits (transformers refuses to import beside another); that folder comes first on
# PYTHONPATH, which every launched rank and child inherits. Everything else is .venv's. Needs the package index
# once per version; about as long as `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
test -x "$PY" || make install
lowest=$(sed -n 's/.*"transformers>=\([0-9][0-9.]*\),.*/\1/p' setup.py)
version=${TRANSFORMERS:-$lowest}
[[ -n "$version" ]] || { echo "no \"transformers>=X,<Y\" range found in setup.py"; exit 1; }
dir=$PWD/.venv/transformers-$version
if [[ ! -f $dir/.installed ]]; then
    rm -rf "$dir"
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --target "$dir" "transformers==$version"
    # Read as a file: importing transformers beside the wrong huggingface_hub fails.
    hub=$("$PY" -c "exec(open('$dir/transformers/dependency_versions_table.py').read()); print(deps['huggingface-hub'])")
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --upgrade --target "$dir" "$hub"
    touch "$dir/.installed"
fi
export PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import transformers, huggingface_hub; print('testing with transformers', transformers.__version__,
'| huggingface_hub', huggingface_hub.__version__, '| from', transformers.__file__)"
# Each argument quoted for the recipe's shell, so that -k "a or b" stays one argument.
args=""
(($#)) && args=$(printf '%q ' "$@")
make test PYTEST_ARGS="$args"
