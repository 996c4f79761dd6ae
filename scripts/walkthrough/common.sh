# Shared by the walkthroughs of docs/operations.md: the release binaries, a scratch directory, free
# loopback ports, the plugin run as a runtime runs it, and a loud failure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# BLOCKIPAM_BIN_DIR: binaries already built elsewhere (blockipam, blockipamctl, blockipam-agent);
# by default the release build and the shipped static plugin, built here when missing.
if [ -n "${BLOCKIPAM_BIN_DIR:-}" ]; then
    BIN="$(realpath "$BLOCKIPAM_BIN_DIR")"
    PLUGIN="$BIN/blockipam"
else
    cargo build --release --locked -q -p blockipamctl -p blockipam-agent
    PLUGIN="$(scripts/build-plugin)"
    BIN="$PWD/target/release"
fi
WORK="$(mktemp -d)"
chmod 0700 "$WORK"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    # BLOCKIPAM_WALKTHROUGH_KEEP=1 keeps the scratch directory (logs, certificates) for a look.
    if [ "${BLOCKIPAM_WALKTHROUGH_KEEP:-0}" = 1 ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

fail() { echo "walkthrough failed: $*" >&2; exit 1; }
step() { printf '\n== %s\n' "$*"; }
show() { printf '$ %s\n' "$*"; "$@"; }

# A loopback TCP port nothing listens on.
free_port() {
    local port
    while :; do
        port=$((20000 + RANDOM % 40000))
        ss -Hltn "sport = :$port" | grep -q . || { echo "$port"; return; }
    done
}

# cni COMMAND CONTAINER NETCONF: the plugin as a runtime runs it; prints its result.
cni() {
    local out
    out="$(CNI_COMMAND="$1" CNI_CONTAINERID="$2" CNI_NETNS=/var/run/netns/walkthrough CNI_IFNAME=eth0 \
        CNI_PATH="$BIN" "$PLUGIN" <<<"$3")" || fail "CNI $1 of $2: $out"
    printf '%s\n' "$out"
}

# wait_for WHAT COMMAND...: retries COMMAND until it succeeds, for up to 30 s in all.
wait_for() {
    local what="$1" deadline=$((SECONDS + 30))
    shift
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -lt "$deadline" ] || fail "timed out waiting for $what"
        sleep 0.1
    done
}

# The addresses an ADD result holds, one per line.
addresses_of() { grep -o '"address": *"[^"]*"' | sed 's/.*"\([^"]*\)"$/\1/'; }
