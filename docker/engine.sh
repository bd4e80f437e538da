#!/usr/bin/env bash
# A Docker engine and the base images for this project's builds: the one the machine has, or a private one.
#
#   bash docker/engine.sh up      print a DOCKER_HOST that answers; with none, install (Debian, as root) and start a
#                                 private engine, and the Compose and Buildx plugins when missing
#   bash docker/engine.sh bases   make sure the base images exist: pulled, or (no registry) made here from Debian
#   bash docker/engine.sh down    stop the private engine, if this script started one, and remove its data
#   bash docker/engine.sh host    print the DOCKER_HOST that answers, or fail
#
# An engine that already answers (DOCKER_HOST, or the default socket) is used as it is, and `down` leaves it alone.
# The private engine touches nothing of the host's network: no bridge, no iptables rules, no IP forwarding; its
# containers use the host's network (`--network host`). Its state lives in $LLM_DOCKER_DIR
# (default /var/tmp/llm-batching-docker): data, socket, pid and log.
#
# Without a registry (the machine this project is tested on reaches only package indexes), the base image
# python:3.11-slim-bookworm is stood in for by Debian bookworm made with mmdebstrap (python3, venv, libpython3.11,
# ca-certificates), tagged with the real name, so the Dockerfiles build unchanged.
set -euo pipefail

STATE="${LLM_DOCKER_DIR:-/var/tmp/llm-batching-docker}"
SOCKET="unix://$STATE/docker.sock"
BASE_IMAGE="python:3.11-slim-bookworm"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# Compose v2 (>= 2.24 for `!reset`) and Buildx are not packaged for bookworm: trixie's static builds are.
PLUGIN_SUITE="trixie"

say() { echo "[engine] $*" >&2; }

answers() {  # answers HOST
    DOCKER_HOST="$1" timeout 20 docker version --format '{{.Server.Version}}' > /dev/null 2>&1
}

host() {
    if [[ -n "${DOCKER_HOST:-}" ]]; then
        answers "$DOCKER_HOST" && { echo "$DOCKER_HOST"; return 0; }
        return 1
    fi
    local candidate
    for candidate in unix:///var/run/docker.sock "$SOCKET"; do
        if answers "$candidate"; then echo "$candidate"; return 0; fi
    done
    return 1
}

as_root() {
    if [[ "$(id -u)" != 0 ]] || ! command -v apt-get > /dev/null; then
        say "no Docker engine answers and this is not root on Debian: install Docker (https://docs.docker.com/engine/install/)"
        exit 1
    fi
}

apt_install() {
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "$@" > /dev/null \
        || { apt-get update -q > /dev/null && apt-get install -y -q --no-install-recommends "$@" > /dev/null; }
}

install_plugins() {  # docker compose and docker buildx, from Debian trixie's packages
    local missing=()
    docker compose version > /dev/null 2>&1 || missing+=(docker-compose)
    docker buildx version > /dev/null 2>&1 || missing+=(docker-buildx)
    [[ ${#missing[@]} -eq 0 ]] && return 0
    as_root
    say "installing ${missing[*]} from Debian $PLUGIN_SUITE"
    local tmp
    tmp="$(mktemp -d)"
    chmod 755 "$tmp"  # apt fetches as its own user (_apt)
    mkdir -p "$tmp/lists/partial"
    echo "deb $DEBIAN_MIRROR $PLUGIN_SUITE main" > "$tmp/sources.list"
    local apt_opts=(-q -o "Dir::Etc::sourcelist=$tmp/sources.list" -o Dir::Etc::sourceparts=- -o "Dir::State::Lists=$tmp/lists")
    apt-get "${apt_opts[@]}" update > /dev/null
    (cd "$tmp" && apt-get "${apt_opts[@]}" download "${missing[@]}" > /dev/null 2>&1)
    local deb
    for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/x"; done
    mkdir -p /usr/libexec/docker/cli-plugins
    cp "$tmp"/x/usr/libexec/docker/cli-plugins/* /usr/libexec/docker/cli-plugins/
    rm -rf "$tmp"
}

up() {
    local found
    if found="$(host)"; then
        install_plugins
        echo "$found"
        return 0
    fi
    [[ -n "${DOCKER_HOST:-}" ]] && { say "DOCKER_HOST=$DOCKER_HOST does not answer"; exit 1; }
    as_root
    if ! command -v dockerd > /dev/null; then
        say "installing Debian's docker.io"
        apt_install docker.io
    fi
    install_plugins
    mkdir -p "$STATE"
    say "starting a private engine in $STATE (no bridge, no iptables)"
    # NOTE: setsid: the engine outlives the shell that started it (make, CI) until `down`.
    setsid dockerd --data-root "$STATE/data" --exec-root "$STATE/exec" --host "$SOCKET" \
        --pidfile "$STATE/docker.pid" --bridge=none --iptables=false --ip-forward=false --ip-masq=false \
        > "$STATE/dockerd.log" 2>&1 < /dev/null &
    local i
    for i in $(seq 1 60); do
        if answers "$SOCKET"; then echo "$SOCKET"; return 0; fi
        sleep 1
    done
    say "the engine did not answer in 60 s; its log: $STATE/dockerd.log"
    tail -20 "$STATE/dockerd.log" >&2
    exit 1
}

down() {
    [[ -f "$STATE/docker.pid" ]] || { say "no private engine to stop"; return 0; }
    local pid
    pid="$(cat "$STATE/docker.pid")"
    if kill -0 "$pid" 2> /dev/null; then
        # Containers first (docker stop's grace), then the engine.
        local running
        running="$(DOCKER_HOST="$SOCKET" docker ps -q 2> /dev/null || true)"
        [[ -n "$running" ]] && DOCKER_HOST="$SOCKET" docker stop -t 40 $running > /dev/null 2>&1 || true
        kill "$pid"
        local i
        for i in $(seq 1 60); do kill -0 "$pid" 2> /dev/null || break; sleep 1; done
        kill -0 "$pid" 2> /dev/null && kill -9 "$pid"
    fi
    # Leftover overlay mounts would keep the data folder busy.
    grep -o " $STATE/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2> /dev/null || true
    rm -rf "$STATE"
    say "private engine stopped, $STATE removed"
}

bases() {
    export DOCKER_HOST
    DOCKER_HOST="$(host)" || { say "no Docker engine answers: run \`bash docker/engine.sh up\` first"; exit 1; }
    if docker image inspect "$BASE_IMAGE" > /dev/null 2>&1; then return 0; fi
    if timeout 300 docker pull -q "$BASE_IMAGE" > /dev/null 2>&1; then return 0; fi
    as_root
    say "$BASE_IMAGE cannot be pulled: standing in for it with Debian bookworm made by mmdebstrap"
    command -v mmdebstrap > /dev/null || apt_install mmdebstrap
    local tar
    tar="$(mktemp --suffix=.tar)"
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates,libpython3.11 \
        bookworm "$tar" "$DEBIAN_MIRROR"
    # What the real image sets and the builds rely on: PATH, a UTF-8 locale, python3 as the command.
    docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "$tar" "$BASE_IMAGE" > /dev/null
    rm -f "$tar"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    host) host ;;
    bases) bases ;;
    *) echo "usage: bash docker/engine.sh up|bases|down|host" >&2; exit 2 ;;
esac
