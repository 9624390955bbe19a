#!/usr/bin/env bash
# Tests deploy/docker-compose.yml on a machine with a Docker engine but no registry:
#   1. a base image made with `docker import` from the host's own shell and shared
#      libraries (no pull), and the images built from the SAME deploy/Dockerfile with that
#      base and host-built binaries (PREBUILT);
#   2. the same compose file plus deploy/compose.local.yml (local images, the host's model
#      cache, `specd trace-sink` receiving OTLP where Jaeger would);
#   3. generate; kill one verifier container; generate again (greedy output identical);
#      scale to 4 verifiers and show the orchestrator routing new sessions to a new one;
#      check the trace sink got spans from all three services;
#   4. tear everything down, also on failure.
#
# Usage: SPECD_MODEL_HOST_DIR=~/.cache/specd/models deploy/compose-test.sh BIN_DIR
# BIN_DIR holds orchestrator, verifier-svc, drafter-svc and specd built on this host.
set -euo pipefail
cd "$(dirname "$0")/.."

bins=${1:?usage: compose-test.sh BIN_DIR}
model_dir=${SPECD_MODEL_HOST_DIR:?set SPECD_MODEL_HOST_DIR to the directory holding the default model}
started=$(date +%s)
say() { printf '[compose-test %3ds] %s\n' "$(( $(date +%s) - started ))" "$*"; }

if docker compose version >/dev/null 2>&1; then
    compose_cmd=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    compose_cmd=(docker-compose)
else
    echo "compose-test: neither 'docker compose' (v2) nor 'docker-compose' (v1) is installed" >&2
    exit 1
fi
for tool in docker jq python3 ldd tar; do
    command -v "$tool" >/dev/null 2>&1 || { echo "compose-test: $tool is required" >&2; exit 1; }
done
say "using: ${compose_cmd[*]} ($("${compose_cmd[@]}" version --short 2>/dev/null || true))"

project="specdtest$$"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
export SPECD_IMAGE="specd-test:$project"
export SPECD_FETCH_IMAGE="specd-fetch-test:$project"
export SPECD_MODEL_HOST_DIR="$model_dir"
# The development key of deploy/dev-api-keys; `specd generate` and `specd replicas` read it.
export SPECD_API_KEY=specd-dev-key
# The certs one-shot service writes the development CA here; clients trust it.
certs=$(mktemp -d) && chmod 755 "$certs"
export SPECD_CERTS_DIR="$certs"
export SPECD_TLS_CA="$certs/ca.pem"
export SPECD_PORT; SPECD_PORT=$(free_port)
export SPECD_METRICS_PORT; SPECD_METRICS_PORT=$(free_port)
export JAEGER_UI_PORT; JAEGER_UI_PORT=$(free_port)
export JAEGER_OTLP_PORT; JAEGER_OTLP_PORT=$(free_port)
base="specd-base:$project"
prebuilt="target/docker-prebuilt"
rootfs=$(mktemp -d)

compose() { "${compose_cmd[@]}" -p "$project" -f deploy/docker-compose.yml -f deploy/compose.local.yml "$@"; }
cleanup() {
    status=$?
    if [ "$status" -ne 0 ]; then
        say "FAILED; service logs follow"
        compose logs --no-color --tail 40 2>&1 | tail -120 || true
    fi
    say "tearing down"
    compose down -v --remove-orphans -t 2 >/dev/null 2>&1 || true
    docker rmi -f "$SPECD_IMAGE" "$SPECD_FETCH_IMAGE" "$base" >/dev/null 2>&1 || true
    rm -rf "$rootfs" "$prebuilt" "$certs"
    say "done (exit $status)"
}
trap cleanup EXIT

# 1. A base image from the host: a shell, cp and mkdir (the Dockerfile's build step), and
#    the shared libraries every binary needs.
mkdir -p "$rootfs/bin" "$rootfs/etc" "$rootfs/tmp" "$rootfs/models"
chmod 1777 "$rootfs/tmp"
rm -rf "$prebuilt" && mkdir -p "$prebuilt"
for b in orchestrator verifier-svc drafter-svc specd; do
    cp "$bins/$b" "$prebuilt/$b"
done
for tool in sh mkdir cp; do
    cp "$(readlink -f "$(command -v "$tool")")" "$rootfs/bin/$tool"
done
for file in "$rootfs"/bin/* "$prebuilt"/*; do
    ldd "$file" | grep -o '/[^ ]*' | while read -r lib; do
        mkdir -p "$rootfs$(dirname "$lib")"
        cp -L "$lib" "$rootfs$lib"
    done
done
printf 'hosts: files dns\n' > "$rootfs/etc/nsswitch.conf"
tar -C "$rootfs" -c . | docker import - "$base" >/dev/null
say "imported base image $base ($(du -sh "$rootfs" | cut -f1))"

# 2. The production Dockerfile, with local bases and the prebuilt binaries.
docker build -q -f deploy/Dockerfile --target runtime \
    --build-arg BUILDER_IMAGE="$base" --build-arg RUNTIME_IMAGE="$base" \
    --build-arg PREBUILT="$prebuilt" -t "$SPECD_IMAGE" . >/dev/null
docker build -q -f deploy/Dockerfile --target model-fetch \
    --build-arg BUILDER_IMAGE="$base" --build-arg RUNTIME_IMAGE="$base" --build-arg PYTHON_IMAGE="$base" \
    --build-arg PREBUILT="$prebuilt" -t "$SPECD_FETCH_IMAGE" . >/dev/null
say "built $SPECD_IMAGE and $SPECD_FETCH_IMAGE from deploy/Dockerfile"

# 3. Up, with two verifiers.
compose up -d --no-build --scale verifier=2 2>&1 | sed 's/^/    /'
url="https://127.0.0.1:$SPECD_PORT"
for _ in $(seq 1 240); do
    if "$bins/specd" health "$url" --timeout-ms 1000 >/dev/null 2>&1; then break; fi
    sleep 0.5
done
"$bins/specd" health "$url"
compose ps | sed 's/^/    /'
replicas() { "$bins/specd" replicas --orchestrator "$url" --json; }
serving() { replicas | jq '[.verifiers[] | select(.health == "serving")] | length'; }
wait_serving() {
    for _ in $(seq 1 240); do
        if [ "$(serving)" -ge "$1" ]; then return 0; fi
        sleep 0.5
    done
    replicas
    echo "fewer than $1 verifiers serving" >&2
    return 1
}
wait_serving 2
say "up: orchestrator serving with $(serving) verifiers"
if "$bins/specd" generate --orchestrator "$url" --api-key wrong-key --prompt hi --max-tokens 1 >/dev/null 2>&1; then
    echo "the orchestrator accepted a wrong API key" >&2
    exit 1
fi
say "a wrong API key is refused"
if env -u SPECD_TLS_CA "$bins/specd" health "http://127.0.0.1:$SPECD_PORT" >/dev/null 2>&1; then
    echo "the orchestrator answered plain text on its TLS port" >&2
    exit 1
fi
say "TLS everywhere: plain text is refused; generation below runs over TLS (mutual between services)"

prompt='def add(a, b):\n    return a + b\n\ndef sub(a, b):'
generate() {
    "$bins/specd" generate --orchestrator "$url" --prompt "$(printf "$prompt")" --max-tokens 24 --json \
        | jq -c '.token_ids'
}
first=$(generate)
say "generated: $first"

# Read all of the listing (`head` would close the pipe early: SIGPIPE under pipefail).
victim=$(compose ps -q verifier | sed -n 1p)
docker kill "$victim" >/dev/null
say "killed verifier container ${victim:0:12}"
second=$(generate)
say "generated after the kill: $second"
if [ "$first" != "$second" ]; then
    echo "greedy output changed after losing a verifier" >&2
    exit 1
fi
say "identical greedy output"

before=$(replicas | jq -r '.verifiers[].endpoint' | sort)
compose up -d --no-build --no-recreate --scale verifier=4 2>&1 | sed 's/^/    /'
wait_serving 4
replicas | jq -r '.verifiers[] | "    \(.endpoint) \(.health) requests=\(.requests)"'
new=$(comm -13 <(echo "$before") <(replicas | jq -r '.verifiers[].endpoint' | sort))
say "scaled to 4 verifiers; new: $(echo "$new" | tr '\n' ' ')"
for _ in $(seq 1 8); do generate >/dev/null; done
routed=0
for endpoint in $new; do
    n=$(replicas | jq --arg e "$endpoint" '.verifiers[] | select(.endpoint == $e) | .requests')
    say "new replica $endpoint served $n calls"
    if [ "$n" -gt 0 ]; then routed=1; fi
done
if [ "$routed" -ne 1 ]; then
    echo "the orchestrator never routed to a new verifier" >&2
    exit 1
fi

sleep 2 # the span batch interval
sink_log=$(compose logs --no-color jaeger 2>/dev/null)
for service in orchestrator verifier-svc drafter-svc; do
    if ! grep -q "span service=$service " <<<"$sink_log"; then
        echo "no spans from $service reached the trace sink; spans by service:" >&2
        grep -o 'span service=[^ ]*' <<<"$sink_log" | sort | uniq -c >&2
        exit 1
    fi
done
say "trace sink received spans: $(grep -o 'span service=[^ ]*' <<<"$sink_log" | sort | uniq -c | tr -s ' \n' ' ')"
say "PASS"
