#!/usr/bin/env bash
# Adds to .gpu-bundle/ (made by ../shared/gpu/make_bundle.sh) what benchmarks/gpu.py needs
# there beyond it: MLflow's SQL tracking store (SQLAlchemy, alembic, Mako), which the
# bundle's mlflow-skinny leaves out, for the machine's Python 3.12. Run from the project
# root with the project's venv active; .gpu-bundle/setup.sh installs every wheel there.
set -euo pipefail
B=.gpu-bundle
[ -d "$B" ] || { echo "no $B: run bash ../shared/gpu/make_bundle.sh first" >&2; exit 2; }
ver() { python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$B" "sqlalchemy==$(ver sqlalchemy)" "alembic==$(ver alembic)" \
  "mako==$(ver mako)"
ls "$B"/*.whl | grep -iE "sqlalchemy|alembic|mako"
