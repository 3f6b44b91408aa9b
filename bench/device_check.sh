#!/usr/bin/env bash
# The device check (bench/device_check.py): CUDA tests, greedy equality on every attention path the
# engine offers there, and throughput against transformers on a ~1B random Llama; one JSON object on
# stdout (progress on stderr). Under 8 minutes on one H200; `--dry-run` runs it here on CPU (< 60 s).
#
#   bash bench/device_check.sh [--dry-run] [--wheels DIR] [--out FILE] [--budget-s S] [--skip-tests]
#
# Python: $PYTHON if set, else /opt/torch/.venv/bin/python3 (the device machine's, with torch), else
# .venv/bin/python, else python3. The project is not installed there: it runs from this checkout, and
# only engine/ and batcher/ are imported (torch, transformers, tokenizers; no Celery, Redis or FastAPI).
#
# Wheels. The device machine has transformers 5.17 and no package index; this project pins 5.24. Carried
# wheels (the device tool's `carry`, 64 MiB for the whole tree) are installed from DIR with
# `pip install --no-index --no-deps --target` into a temporary folder put first on PYTHONPATH; DIR is
# --wheels, else .device-wheels/ when it holds wheels (not in --dry-run: here they are for another python).
# Prepare them here, once (about 18 MB; .device-wheels/ is git-ignored):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .device-wheels transformers==5.24.0 tokenizers==0.23.3 regex==2026.11.19
#
# (transformers checks regex>=2025.10.22 at import; torch, safetensors 0.8, huggingface_hub, numpy,
# tqdm, typer and pytest are already there.) Then, with the device tool:
#
#   run(command="bash bench/device_check.sh --out $OUT/device_check.json", carry=[".device-wheels"], timeout_s=540)
#
# Exit status: 0 when everything ran and agreed, 1 on any error, mismatch or test failure, 2 without CUDA
# (outside --dry-run). The JSON is printed either way; --out is rewritten after every phase.
set -euo pipefail
cd "$(dirname "$0")/.."

dry=0
wheels=""
args=()
while (($#)); do
    case "$1" in
        --wheels) wheels="${2:?--wheels needs a folder}"; shift 2 ;;
        --wheels=*) wheels="${1#--wheels=}"; shift ;;
        --dry-run) dry=1; args+=("$1"); shift ;;
        *) args+=("$1"); shift ;;
    esac
done

if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x /opt/torch/.venv/bin/python3 ]]; then
    py=/opt/torch/.venv/bin/python3
elif [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py=python3
fi

if [[ -z "$wheels" && $dry == 0 ]] && compgen -G ".device-wheels/*.whl" >/dev/null; then
    wheels=.device-wheels
fi
if [[ -z "$wheels" && $dry == 0 ]]; then
    echo "device_check: no wheels carried: using this machine's transformers (see the header)" >&2
fi
if [[ -n "$wheels" ]]; then
    compgen -G "$wheels/*.whl" >/dev/null || { echo "device_check: no wheels in $wheels" >&2; exit 2; }
    site="$(mktemp -d "${TMPDIR:-/tmp}/weightq-device-site.XXXXXX")"
    trap 'rm -rf "$site"' EXIT
    echo "device_check: installing $(cd "$wheels" && echo *.whl) into $site" >&2
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$wheels"/*.whl >&2
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    DEVICE_CHECK_WHEELS="$(cd "$wheels" && ls -- *.whl | paste -sd, -)"
    export DEVICE_CHECK_WHEELS
fi

# Nothing can be downloaded on the device machine: fail fast instead of waiting on the hub.
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
"$py" -m bench.device_check ${args[@]+"${args[@]}"}
