#!/usr/bin/env bash
# `pip install` inside an image build (docker/Dockerfile, docker/locust.Dockerfile), with what a build can be handed
# from outside:
#   - a certificate authority, as the build secret `ca` (`--secret id=ca,src=FILE`, PEM): trusted besides the
#     image's own bundle, for this command only (registries behind a TLS-inspecting proxy); nothing of it stays in
#     a layer;
#   - a wheelhouse: wheels in docker/wheels/ (mounted at /wheels) are found besides the index.
#
#   pip-install [pip install options and requirements]
set -euo pipefail

if [[ -s /run/secrets/ca ]]; then
    bundle="$(mktemp)"
    trap 'rm -f "$bundle"' EXIT
    cat /etc/ssl/certs/ca-certificates.crt /run/secrets/ca > "$bundle"
    export PIP_CERT="$bundle"
fi
wheelhouse=()
if compgen -G "/wheels/*.whl" > /dev/null; then
    wheelhouse=(--find-links /wheels)
fi
python3 -m pip install --no-cache-dir "${wheelhouse[@]}" "$@"
