#!/usr/bin/env bash
# Start tritonserver with its admin APIs behind a key, as `python -m backend.triton.serve` does outside a container.
#
#   bash docker/triton-serve.sh --model-repository=/opt/llm/model_repository [more tritonserver options]
#
# shared-memory, trace and logging (and model-repository when --model-control-mode is explicit or poll) answer
# only requests whose header admin-key (gRPC: triton-grpc-protocol-admin-key) is $TRITON_ADMIN_KEY. Without
# TRITON_ADMIN_KEY a random key is made at each start and never printed, so those APIs stay closed. An option
# --http-restricted-api or --grpc-restricted-protocol given here replaces this script's for that protocol.
# tests/test_security.py checks that this script and backend/triton/serve.py pass the same flags.
set -euo pipefail

apis="shared-memory,trace,logging"
own_http=false
own_grpc=false
mode=none
previous=""
for arg in "$@"; do
    case "$arg" in
        --http-restricted-api | --http-restricted-api=*) own_http=true ;;
        --grpc-restricted-protocol | --grpc-restricted-protocol=*) own_grpc=true ;;
        --model-control-mode=*) mode="${arg#*=}" ;;
    esac
    if [[ "$previous" == "--model-control-mode" ]]; then
        mode="$arg"
    fi
    previous="$arg"
done
if [[ "$mode" != "none" ]]; then
    apis="shared-memory,model-repository,trace,logging"  # load and unload exist under model control
fi

key="${TRITON_ADMIN_KEY:-}"
if [[ -z "$key" ]]; then
    key="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
    echo "[triton-serve] TRITON_ADMIN_KEY is not set: the admin APIs ($apis) are closed with a random key;" \
        "set TRITON_ADMIN_KEY to use them" >&2
fi

restrict=()
if ! $own_http; then
    restrict+=("--http-restricted-api=$apis:admin-key=$key")
fi
if ! $own_grpc; then
    restrict+=("--grpc-restricted-protocol=$apis:admin-key=$key")
fi
# tritonserver runs under backend/triton/shutdown.py: SIGTERM (docker stop, Kubernetes) reaches the models' stubs
# too, they drain, and the client connections still open afterwards are closed, so the models unload and the exit
# status is 0. (Run as a file, not as -m backend.triton.shutdown: importing the package would set its OpenMP
# variables for the server.)
exec python3 "$(dirname "${BASH_SOURCE[0]}")/../backend/triton/shutdown.py" run -- tritonserver "$@" "${restrict[@]}"
