#!/usr/bin/env bash
# The wheelhouse the GPU check carries (docs/gpu.md): the project's dependencies that the GPU
# image lacks (hydra-core, omegaconf, mlflow-skinny with its sqlite tracking store, submitit,
# datasets, torchao, and everything they need), pinned to the CI venv's versions, for the image's
# Python (3.12: the device tool's KINDS.md). The image already has torch 2.11, transformers 5.17,
# accelerate, peft, numpy, pandas, pyarrow, sentencepiece, tokenizers, safetensors, pytest and
# the common packages that come with them (requests, pyyaml, packaging, anyio, click,
# cloudpickle, protobuf, huggingface-hub, fsspec, xxhash, ...): those are not bundled.
#
#   bash scripts/offline_wheels.sh [DIR=.whl] [PYTHON_VERSION=3.12] [BENCH_DIR=]
#
# (DIR relative to the repository root.)#
# Then it measures what a device run carries: the working tree as the device tool sends it
# (tracked files, and untracked ones git does not ignore) plus DIR, against the tool's 64 MiB,
# and fails when it is over. scripts/gpu_check.sh installs DIR on the GPU machine with
#   python3 -m pip install --no-index --no-deps --no-compile --target <dir> DIR/*.whl
#
# Needs network and pip here. antlr4-python3-runtime 4.9.3 (hydra's parser runtime) exists on
# PyPI only as an sdist, so it is built here into a pure py3-none-any wheel.
# typing-extensions is bundled too (pydantic 2.14 needs >= 4.16, newer than some images have),
# and fsspec (datasets 5.2 pins fsspec <= 2026.9.0); datasets 5.2 needs the machine's
# pyarrow >= 24. mlflow-skinny is mlflow without its UI server: the client, the sqlite tracking
# store (with sqlalchemy and alembic) and the system metrics, all a run uses; the full mlflow
# adds the UI server (12 MiB, and flask, gunicorn, graphene, docker, huey, skops).
#
# BENCH_DIR (third argument or env var; empty = skip) also gets a small second wheelhouse for
# benchmarks/throughput.py's torchtitan runner (benchmarks/peers/titan.py), which the GPU check
# does not run, with only what its import path needs beyond the machine and DIR. TORCHTITAN
# (env var) picks the generation: 0.2.2 (the default; the GPU image's torch 2.11 cannot import
# 0.3, which needs torch.distributed.fsdp.DataParallelMeshDims from torch >= 2.12) or 0.3.0
# (adds spmd-types). Left out on purpose: wandb (imported only with metrics.enable_wandb),
# torch_checkpointing (only torchtitan's optional torch_checkpointing checkpointer imports it),
# typeguard (tyro imports it only for CLI parsing; the runner builds its config directly),
# tensorboard, einops and pillow (in the GPU image). torchtitan pins datasets<4.8, but its import
# path works with DIR's datasets 5.2 (the runner never loads a dataset). xxhash is an
# import-time dependency of datasets itself. Install it next to DIR and point
# benchmarks/throughput.py's --bench-venv at a directory whose bin/python runs python3.
set -euo pipefail
cd "$(dirname "$0")/.."

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
    # eval.harness / python -m llama_fsdp.evaluate: lm-eval and what its import path needs
    # (sacrebleu: lm_eval.api.metrics imports it; evaluate, pytablewriter for its tables).
    # Left out: scikit-learn + scipy (~50 MiB; only some tasks' f1 / mcc metrics import them),
    # rouge-score + nltk + absl-py (only tasks scored by ROUGE)
    lm-eval==0.4.13
    sacrebleu==2.6.0
    portalocker==4.4.2
    tabulate==0.10.0
    colorama==0.4.6
    lxml==6.1.3
    more-itertools==11.2.1
    evaluate==0.4.6
    pytablewriter==1.2.1
    dataproperty==1.1.1
    mbstrdecoder==1.1.5
    typepy==1.3.5
    tabledata==1.3.5
    tcolorpy==0.1.7
    pathvalidate==3.3.1
    chardet==6.0.0.post1
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
# lm-eval's sqlitedict and word2number: sdists too (pure Python)
$PIP wheel --no-deps --no-binary=:all: -w "$DIR" sqlitedict==2.1.0 word2number==1.1

check "$DIR"

carried() {  # carried DIR: the working tree as the device tool sends it, plus DIR, in MiB
    python3 - "$1" <<'PYTHON'
import subprocess, sys
from pathlib import Path

LIMIT = 64 * 2**20
names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, text=True, check=True).stdout.split("\0")
wheel_dir = Path(sys.argv[1]).resolve()
tree = sum(p.stat().st_size for p in map(Path, filter(None, set(names)))
           if p.is_file() and wheel_dir not in p.resolve().parents)
wheels = sum(p.stat().st_size for p in wheel_dir.rglob("*") if p.is_file())
total = tree + wheels
print(f"carried by a device run: the tree {tree / 2**20:.1f} MiB + {sys.argv[1]} "
      f"{wheels / 2**20:.1f} MiB = {total / 2**20:.1f} MiB of {LIMIT / 2**20:.0f} MiB")
if total > LIMIT:
    sys.exit("over the device tool's limit: carry less (git-ignore big untracked files)")
PYTHON
}

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    carried "$DIR"
fi
