#!/bin/sh
# Fresh secrets for docker-compose.yml, next to this script: the Raft password, an admin token
# (for operators: not mounted into any container), a read-only gateway token, one engine token
# per node id (default: the four worker stubs; add vllm1 for deploy/docker-compose.vllm.yml),
# and auth_tokens, the replicas' ROLE:NODE_PATTERN:TOKEN file listing all of them.
#
#   deploy/secrets/generate.sh [NODE_ID...]
#
# Compose mounts these files into the containers with their host permissions, and the
# containers run as uid 10001: the files are world-readable (0644) and this directory is
# 0700, so no other user of the host can reach them. Running it again replaces every secret
# (then recreate the containers: `docker compose up -d --force-recreate`).
set -eu
cd "$(dirname "$0")"
[ "$#" -gt 0 ] || set -- worker1 worker2 worker3 worker4
chmod 700 .
umask 022
token() { python3 -c 'import secrets; print(secrets.token_urlsafe(32))'; }
token > raft_password
token > admin.token
token > gateway.token
{
    echo "# role:node pattern:token, written by deploy/secrets/generate.sh"
    echo "admin:*:$(cat admin.token)"
    echo "gateway:*:$(cat gateway.token)"
    for node in "$@"; do
        token > "$node.token"
        echo "engine:$node:$(cat "$node.token")"
    done
} > auth_tokens
echo "wrote raft_password, auth_tokens, admin.token, gateway.token and $(printf '%s.token ' "$@")in $(pwd)"
