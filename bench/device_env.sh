#!/usr/bin/env bash
# The gateway's Python packages for the GPU machine, which has torch, triton, transformers, numpy, pyyaml,
# prometheus-client, httpx, aiohttp, uvloop and pandas but no registry and no fastapi, uvicorn, pydantic, sqlalchemy,
# alembic, faiss, llguidance (structured outputs), jsonschema (tool definitions) or py-spy (profiles).
#   bash bench/device_env.sh download   # here, with PyPI: wheels for CPython 3.12 manylinux x86_64 into .whl/
#   bash bench/device_env.sh install    # there (the run carries .whl): installs them into /tmp/site
#   export PYTHONPATH=/tmp/site:$PWD    # then `platform serve --local` and bench/serve.py run on the GPU
# Each package is pinned to the version this checkout's .venv has (what `make test` ran here), where it has it.
# .whl/ is ignored by git and stays well under the 64 MiB a run may carry (about 35 MB). Ray (79 MB) and the
# all-MiniLM package (83 MB) do not fit: the Ray Serve path is measured on CPU, and the semantic cache is off there.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
# the web stack and the ledger; their own dependencies are named, since --no-deps keeps torch out
PACKAGES=(fastapi starlette uvicorn httptools pydantic pydantic-core annotated-types typing-inspection
          sqlalchemy greenlet alembic mako sniffio
          annotated-doc opentelemetry-api faiss-cpu llguidance
          jsonschema jsonschema-specifications referencing rpds-py attrs
          py-spy)  # py-spy: bench/serve.py --profile samples the gateway under load

case "${1:-}" in
  download)
    mkdir -p "$WHEELS"
    VENV_PY=.venv/bin/python
    [[ -x $VENV_PY ]] || VENV_PY=python3
    PINNED=()
    for package in "${PACKAGES[@]}"; do
      version=$("$VENV_PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$package" \
        2>/dev/null) && PINNED+=("$package==$version") || PINNED+=("$package")
    done
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$WHEELS" "${PINNED[@]}"
    du -sh "$WHEELS"
    ;;
  install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
    echo "installed into /tmp/site: export PYTHONPATH=/tmp/site:\$PWD"
    ;;
  *)
    echo "usage: bash bench/device_env.sh download|install" >&2
    exit 2
    ;;
esac
