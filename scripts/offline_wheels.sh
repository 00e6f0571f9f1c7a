#!/usr/bin/env bash
# Builds a wheelhouse of the project's pure dependencies (hydra-core, omegaconf, mlflow-skinny
# with its sqlite tracking store, submitit, datasets, torchao, and everything they need) for an offline
# machine whose Python environment already has torch, transformers, accelerate, numpy, pandas,
# pyarrow, sentencepiece, tokenizers, safetensors (and the other common packages that come with
# them: requests, pyyaml, packaging, typing-extensions, anyio, click, cloudpickle, protobuf,
# huggingface-hub, ...). Those are not bundled. Versions are pinned to match the CI venv.
#
#   scripts/offline_wheels.sh [DIR=.whl] [PYTHON_VERSION=3.12] [BENCH_DIR=]
#
# Install on the offline machine with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#
# Needs network and pip here. antlr4-python3-runtime 4.9.3 (hydra's parser runtime) exists on
# PyPI only as an sdist, so it is built here into a pure py3-none-any wheel.
# typing-extensions is bundled too (pydantic 2.14 needs >= 4.16, newer than some images have);
# datasets 5.2 needs the machine's pyarrow >= 24.
#
# BENCH_DIR (third argument or env var; empty = skip) also gets a small second wheelhouse for
# benchmarks/throughput.py's torchtitan runner (benchmarks/peers/titan.py), with only what its
# import path needs beyond the machine and DIR. TORCHTITAN (env var) picks the generation:
# 0.2.2 (the default; the GPU image's torch 2.11 cannot import 0.3, which needs
# torch.distributed.fsdp.DataParallelMeshDims from torch >= 2.12) or 0.3.0 (adds spmd-types).
# Left out on purpose: wandb (imported only with metrics.enable_wandb), torch_checkpointing
# (only torchtitan's optional torch_checkpointing checkpointer imports it), typeguard (tyro
# imports it only for CLI parsing; the runner builds its config directly), tensorboard,
# einops and pillow (in the GPU image). torchtitan pins datasets<4.8, but its import path works
# with DIR's datasets 5.2 (the runner never loads a dataset). xxhash is an import-time
# dependency of datasets itself.
# Install next to DIR on the offline machine, and point --bench-venv at a directory whose
# bin/python is the machine's python3:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-bench BENCH_DIR/*.whl
#   export PYTHONPATH=/tmp/site-bench:/tmp/site
#   mkdir -p /tmp/bv/bin && ln -sf "$(command -v python3)" /tmp/bv/bin/python
#   python3 benchmarks/throughput.py ... --bench-venv /tmp/bv
set -euo pipefail

DIR=${1:-.whl}
PY=${2:-3.12}
BENCH_DIR=${3:-${BENCH_DIR:-}}
PIP=${PIP:-python3 -m pip}

PINS=(
    # hydra
    hydra-core==1.3.8
    omegaconf==2.3.1
    # mlflow client + local sqlite tracking store
    mlflow-skinny==3.17.2
    sqlalchemy==2.1.9
    alembic==1.20.1
    mako==1.4.3
    cachetools==7.3.2
    databricks-sdk==0.156.0
    google-auth==2.62.2
    pyasn1-modules==0.4.2
    pyasn1==0.6.5
    cryptography==50.0.2
    cffi==2.1.1
    pycparser==3.12
    fastapi==0.165.0
    starlette==1.10.0
    uvicorn==0.54.0
    gitpython==3.2.1
    gitdb==4.0.12
    smmap==5.0.3
    importlib-metadata==9.1.0
    opentelemetry-api==1.45.2
    opentelemetry-sdk==1.45.2
    opentelemetry-proto==1.45.2
    opentelemetry-semantic-conventions==0.66b2
    pydantic==2.14.3
    pydantic-core==2.50.4
    annotated-types==0.8.0
    typing-inspection==0.4.5
    python-dotenv==1.2.4
    typing-extensions==4.16.0
    sqlparse==0.6.1
    # SLURM launcher
    submitit==1.5.4
    # low-bit AdamW (optim=adamw8bit | adamw4bit). The optimizers are Python + torch.compile;
    # 0.18 loads its bundled kernels only on torch >= 2.11 (the GPU image's) and has the
    # torch 2.11 code paths its optimizer states need (_wrap_tensor_autograd). One abi3 wheel
    # (cp310-abi3, manylinux_2_24 / 2_28) serves Python 3.10+.
    torchao==0.18.0
    # datasets (pins fsspec<=2026.9.0, dill<0.4.2, multiprocess<0.70.20)
    datasets==5.2.0
    dill==0.4.1
    multiprocess==0.70.19
    fsspec==2026.9.0
)

# benchmarks/throughput.py's torchtitan runner (BENCH_DIR, see above)
TORCHTITAN=${TORCHTITAN:-0.2.2}
BENCH_PINS=(
    torchtitan==$TORCHTITAN
    torchdata==0.11.0
    tyro==1.0.17
    docstring-parser==0.18.0
    xxhash==4.1.0
)
case "$TORCHTITAN" in
    0.2.*) ;;
    0.3.*) BENCH_PINS+=(spmd-types==0.2.3) ;;
    *) echo "TORCHTITAN=$TORCHTITAN: this script knows the import paths of 0.2.x and 0.3.x" >&2
       exit 2 ;;
esac

download() {  # download DEST PIN...
    local dest=$1; shift
    mkdir -p "$dest"
    $PIP download --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 \
        -d "$dest" "$@"
}

check() {  # check DEST: one version per package
    local dest=$1 n_files n_names
    ls -l "$dest"/*.whl
    du -sh "$dest"
    n_files=$(ls "$dest"/*.whl | wc -l)
    n_names=$(ls "$dest"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z' 'a-z' | sort -u | wc -l)
    if [ "$n_files" != "$n_names" ]; then
        echo "error: $dest holds more than one version of some package" >&2
        exit 1
    fi
    echo "$n_files wheels in $dest"
}

if [ -n "$BENCH_DIR" ]; then
    download "$BENCH_DIR" "${BENCH_PINS[@]}"
    check "$BENCH_DIR"
fi

download "$DIR" "${PINS[@]}"

# sdist only on PyPI: build the (pure-Python) wheel here.
$PIP wheel --no-deps --no-binary=:all: -w "$DIR" antlr4-python3-runtime==4.9.3

check "$DIR"
