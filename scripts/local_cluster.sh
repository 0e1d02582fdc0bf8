#!/usr/bin/env bash
# A multi-node Ray cluster on this machine, for trying `albert submit` and multi-worker runs before a real cluster:
# one head node and ALBERT_WORKERS worker nodes (separate raylets, object stores and agents), token auth on,
# the dashboard / job server on 127.0.0.1 only.
#
#   bash scripts/local_cluster.sh start     # prints the job server address and what to export
#   bash scripts/local_cluster.sh status
#   eval "$(bash scripts/local_cluster.sh env)"   # RAY_ADDRESS, RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH for its clients
#   bash scripts/local_cluster.sh stop      # stops only the nodes this script started (by their pids)
#
# Settings (environment): ALBERT_WORKERS (2), ALBERT_HEAD_CPUS (1), ALBERT_WORKER_CPUS (1),
# ALBERT_OBJECT_STORE_MB (512 per node), ALBERT_GCS_PORT (6390), ALBERT_DASHBOARD_PORT (8265),
# ALBERT_CLUSTER_DIR (/tmp/albert-cluster-$UID: Ray's temp dir, logs, pids, the token file), ALBERT_VENV (.venv).
#
# Each node is a `ray start --block` process in its own session; stopping sends it SIGTERM, on which Ray kills
# every process it started for that node. `ray stop` is never used: it would stop every Ray on the machine.
# Note: Ray 2.60 binds its core services (GCS, raylets, object managers) to all interfaces whatever
# --node-ip-address says (it maps 127.0.0.1 to the routable IP); token auth guards them. Only the dashboard and
# job server can be held to 127.0.0.1, and are. (Ray keeps 127.0.0.1 only as a one-machine Ray, its macOS setting
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, under which `ray start` refuses worker nodes: albert's embedded Ray,
# services.cluster.connect, and the tests' clusters, tests/ray_clusters.py, use it; this script cannot.)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV=${ALBERT_VENV:-$REPO/.venv}
export PATH="$VENV/bin:$PATH" # the venv's ray, python and albert first: every node runs jobs with them
DIR=${ALBERT_CLUSTER_DIR:-/tmp/albert-cluster-$(id -u)}
WORKERS=${ALBERT_WORKERS:-2}
HEAD_CPUS=${ALBERT_HEAD_CPUS:-1}
WORKER_CPUS=${ALBERT_WORKER_CPUS:-1}
OBJECT_STORE_BYTES=$((${ALBERT_OBJECT_STORE_MB:-512} * 1024 * 1024))
GCS_PORT=${ALBERT_GCS_PORT:-6390}
DASHBOARD_PORT=${ALBERT_DASHBOARD_PORT:-8265}
TOKEN_FILE=$DIR/auth_token
ADDRESS=http://127.0.0.1:$DASHBOARD_PORT

# Every node and every client of this cluster runs with the same auth settings.
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN_FILE
unset RAY_AUTH_TOKEN RAY_ADDRESS

alive() { # pid file -> true when that pid is one of our `ray start` processes
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ -n $pid && -r /proc/$pid/cmdline ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "--temp-dir=$DIR/ray"
}

start_node() { # name, then ray start arguments
    local name=$1
    shift
    if alive "$DIR/$name.pid"; then
        echo "$name already running (pid $(cat "$DIR/$name.pid"))"
        return
    fi
    setsid ray start --block --temp-dir="$DIR/ray" --object-store-memory="$OBJECT_STORE_BYTES" \
        --disable-usage-stats "$@" >"$DIR/$name.log" 2>&1 </dev/null &
    echo $! >"$DIR/$name.pid"
    for _ in $(seq 120); do
        grep -q "Ray runtime started" "$DIR/$name.log" && return
        alive "$DIR/$name.pid" || break
        sleep 0.5
    done
    echo "$name did not start; last lines of $DIR/$name.log:" >&2
    tail -n 20 "$DIR/$name.log" >&2
    exit 1
}

free_port() {
    python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

nodes_summary() { # alive nodes and their CPUs, asked of the cluster itself
    python - "$GCS_PORT" <<'EOF'
import sys
import ray
ray.init(address=f"127.0.0.1:{sys.argv[1]}", logging_level="ERROR", log_to_driver=False)
nodes = [n for n in ray.nodes() if n["Alive"]]
for n in nodes:
    print(f"  node {n['NodeID'][:12]}  CPU {n['Resources'].get('CPU', 0):g}  {'head' if n['Resources'].get('node:__internal_head__') else 'worker'}")
print(f"  {len(nodes)} nodes, {sum(n['Resources'].get('CPU', 0) for n in nodes):g} CPUs")
EOF
}

cmd_start() {
    mkdir -p "$DIR"
    chmod 700 "$DIR"
    if [[ ! -s $TOKEN_FILE ]]; then
        (umask 077 && python -c 'import secrets; print(secrets.token_hex(32), end="")' >"$TOKEN_FILE")
    fi
    start_node head --head --port="$GCS_PORT" --num-cpus="$HEAD_CPUS" \
        --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
        --dashboard-agent-listen-port="$(free_port)" --ray-client-server-port="$(free_port)"
    for i in $(seq "$WORKERS"); do
        start_node "worker-$i" --address="127.0.0.1:$GCS_PORT" --num-cpus="$WORKER_CPUS" \
            --dashboard-agent-listen-port="$(free_port)"
    done
    echo "local Ray cluster up: 1 head + $WORKERS workers (logs and pids in $DIR)"
    nodes_summary
    cat <<EOF

Job server: $ADDRESS  (dashboard in a browser: the same URL; it asks for the token)
Use it from this machine (deploy.md, "Try it locally first"):
  eval "\$(bash scripts/local_cluster.sh env)"    # that is: export RAY_ADDRESS=$ADDRESS RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN_FILE
  albert submit model info --wait
  albert jobs list
EOF
}

cmd_env() { # the client settings of this cluster, as shell exports (eval them)
    echo "export RAY_ADDRESS=$ADDRESS RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN_FILE"
}

ours() { # pids of the processes whose command line names this cluster's directory (its nodes' children)
    local proc args
    for proc in /proc/[0-9]*; do
        [[ ${proc#/proc/} == "$$" || ${proc#/proc/} == "$BASHPID" ]] && continue
        mapfile -d '' args <"$proc/cmdline" 2>/dev/null || continue
        if [[ "${args[*]}" == *"$DIR"* ]]; then echo "${proc#/proc/}"; fi
    done
}

cmd_stop() {
    local pidfile pid names=()
    for pidfile in "$DIR"/worker-*.pid "$DIR"/head.pid; do # workers first, the head last
        [[ -e $pidfile ]] || continue
        if alive "$pidfile"; then
            pid=$(cat "$pidfile")
            kill -TERM "$pid"
            names+=("$pidfile")
        fi
    done
    for pidfile in "${names[@]}"; do
        pid=$(cat "$pidfile")
        for _ in $(seq 60); do
            alive "$pidfile" || break
            sleep 0.5
        done
        if alive "$pidfile"; then
            kill -KILL -- "-$pid" 2>/dev/null || true # its session's process group: only what it started
        fi
    done
    # A node's children (workers, agents) can outlive its `ray start` by a moment on a busy machine: wait for them,
    # then kill what is left of this cluster (only processes that name its directory).
    local left
    for _ in $(seq 60); do
        left=$(ours)
        [[ -z $left ]] && break
        sleep 0.5
    done
    if [[ -n $left ]]; then
        # shellcheck disable=SC2086 # one pid per word
        kill -KILL $left 2>/dev/null || true
    fi
    rm -f "$DIR"/*.pid
    echo "stopped ${#names[@]} node(s) of the local cluster in $DIR"
}

cmd_status() {
    local pidfile running=0
    for pidfile in "$DIR"/head.pid "$DIR"/worker-*.pid; do
        [[ -e $pidfile ]] || continue
        if alive "$pidfile"; then
            echo "$(basename "$pidfile" .pid): running (pid $(cat "$pidfile"))"
            running=$((running + 1))
        else
            echo "$(basename "$pidfile" .pid): not running"
        fi
    done
    if ! alive "$DIR/head.pid"; then
        echo "no local cluster running (start it with: bash scripts/local_cluster.sh start)"
        return 1
    fi
    nodes_summary
    echo "job server: $ADDRESS  (RAY_AUTH_TOKEN_PATH=$TOKEN_FILE)"
}

case "${1:-}" in
start) cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
env) cmd_env ;;
*)
    echo "usage: $0 start|stop|status|env" >&2
    exit 2
    ;;
esac
