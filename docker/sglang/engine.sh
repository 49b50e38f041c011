#!/usr/bin/env bash
# Entry point of an SGLang engine container (compose service `sglang`, official SGLang image).
#
# Every replica of the service sees all of the node's GPUs. It claims one free *slot* — a
# group of ENGINE_TP consecutive GPUs from ENGINE_GPUS — by taking an exclusive flock on
# $ENGINE_SLOT_DIR/slot-<k> (a volume shared by the replicas of one node), and keeps the lock
# for its lifetime (the lock dies with the process, so a restarted replica can claim again).
# So `docker compose up --scale sglang=N` gives N engines on N distinct GPU groups; a replica
# that finds no free slot exits with an error instead of sharing a GPU.
#
#   ENGINE_GPUS=0,1,2,3 ENGINE_TP=2  → slot 0 = GPUs 0,1; slot 1 = GPUs 2,3
#
# Port: ENGINE_PORT, plus the slot number when ENGINE_PORT_PER_SLOT=1 (host networking,
# where replicas share the node's ports: slot k listens on ENGINE_PORT + k). The chosen
# address goes to /tmp/asyncrl-engine-addr for the healthcheck.
#
# The server: python3 -m sglang.launch_server with the flags asyncrl needs (names checked
# against sglang 0.5.18 and 0.5.23's server_args.py) —
#   --enable-metrics (Prometheus sglang:*), --tool-call-parser (OpenAI tool calls; `qwen`,
#   of which `qwen25` is a deprecated alias), the API key (every route but /health and
#   /metrics; asyncrl's engine client sends it on data and control routes alike, see
#   docs/deployment.md; ENGINE_API_KEY, or the file ENGINE_API_KEY_FILE names) in a `--config` YAML file only the server's user can read, not as
#   `--api-key` on a command line any process of the container can read (every supported
#   release reads --config; ENGINE_API_KEY is then unset), --tp-size, --host/--port —
# then ENGINE_EXTRA_ARGS (word-split), then any arguments given to this script.
#
# SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 (unless set otherwise): `/health` answers from
# the HTTP server alone, so the container healthcheck and gateways see a live engine while a
# weight sync keeps it paused (with the default 1, /health is a one-token generation that
# waits behind the pause and answers 503 after 20 s). asyncrl's rollout service probes
# /health_generate itself when the engine is not paused for a sync.
# ENGINE_WEIGHT_GROUP_TIMEOUT_S (default 360): the weight-update group's timeout, through asyncrl's
# hook in ENGINE_HOOK_DIR (default: /opt/asyncrl/sglang_hooks, where compose mounts
# launcher/sglang_hooks, else the launcher/sglang_hooks of the checkout this script is in).
# ENGINE_DRY_RUN=1 prints the command instead of running it (tests/deploy).
set -euo pipefail

: "${ENGINE_MODEL_PATH:?ENGINE_MODEL_PATH is required (a model directory under /models)}"
if [[ -z "${ENGINE_API_KEY:-}" && -n "${ENGINE_API_KEY_FILE:-}" ]]; then
    # a Docker secret (compose: /run/secrets/engine_api_key): the key is in no environment
    if [[ ! -r "$ENGINE_API_KEY_FILE" ]]; then
        echo "engine.sh: cannot read ENGINE_API_KEY_FILE=$ENGINE_API_KEY_FILE" >&2
        exit 2
    fi
    ENGINE_API_KEY="$(cat "$ENGINE_API_KEY_FILE")"
fi
: "${ENGINE_API_KEY:?ENGINE_API_KEY or ENGINE_API_KEY_FILE is required}"
ENGINE_GPUS="${ENGINE_GPUS:-0}"
ENGINE_TP="${ENGINE_TP:-1}"
ENGINE_HOST="${ENGINE_HOST:-0.0.0.0}"
ENGINE_PORT="${ENGINE_PORT:-30000}"
ENGINE_PORT_PER_SLOT="${ENGINE_PORT_PER_SLOT:-0}"
ENGINE_TOOL_CALL_PARSER="${ENGINE_TOOL_CALL_PARSER:-qwen}"
ENGINE_MEM_FRACTION="${ENGINE_MEM_FRACTION:-0.85}"
ENGINE_SLOT_DIR="${ENGINE_SLOT_DIR:-/var/lock/asyncrl-engines}"
ENGINE_ADDR_FILE="${ENGINE_ADDR_FILE:-/tmp/asyncrl-engine-addr}"

IFS=',' read -r -a gpus <<< "${ENGINE_GPUS// /}"
if ! [[ "$ENGINE_TP" =~ ^[1-9][0-9]*$ ]]; then
    echo "engine.sh: ENGINE_TP must be a positive integer, got '$ENGINE_TP'" >&2
    exit 2
fi
slots=$(( ${#gpus[@]} / ENGINE_TP ))
if (( slots == 0 )); then
    echo "engine.sh: ENGINE_GPUS=$ENGINE_GPUS has fewer than ENGINE_TP=$ENGINE_TP GPUs" >&2
    exit 2
fi

mkdir -p "$ENGINE_SLOT_DIR"
slot=-1
for (( k = 0; k < slots; k++ )); do
    exec {lock_fd}>"$ENGINE_SLOT_DIR/slot-$k"
    if flock -n "$lock_fd"; then
        slot=$k
        break  # keep lock_fd open: it is inherited by the server through exec
    fi
    exec {lock_fd}>&-
done
if (( slot < 0 )); then
    echo "engine.sh: all $slots engine slots of ENGINE_GPUS=$ENGINE_GPUS (ENGINE_TP=$ENGINE_TP) are taken;" \
         "scale the sglang service to at most $slots replicas on this node" >&2
    exit 3
fi

visible=$(IFS=','; echo "${gpus[*]:$(( slot * ENGINE_TP )):$ENGINE_TP}")
port=$ENGINE_PORT
if [[ "$ENGINE_PORT_PER_SLOT" == "1" ]]; then
    port=$(( ENGINE_PORT + slot ))
fi
probe_host=$ENGINE_HOST
[[ "$probe_host" == "0.0.0.0" ]] && probe_host=127.0.0.1
echo "$probe_host:$port" > "$ENGINE_ADDR_FILE"
export CUDA_VISIBLE_DEVICES="$visible"
# NCCL's and gloo's own sockets of the weight group on the interface of ENGINE_HOST (a node's
# private address), not every interface (issue 48); an operator's own setting stays
if [[ "$ENGINE_HOST" != "0.0.0.0" && -z "${NCCL_SOCKET_IFNAME:-}${GLOO_SOCKET_IFNAME:-}" ]]; then
    ifname=$(ENGINE_HOST="$ENGINE_HOST" python3 -c 'import os, psutil
want = os.environ["ENGINE_HOST"]
print(next((n for n, addrs in psutil.net_if_addrs().items() for a in addrs if a.address.split("%")[0] == want), ""))' 2>/dev/null || true)
    if [[ -n "$ifname" ]]; then
        export NCCL_SOCKET_IFNAME="$ifname" GLOO_SOCKET_IFNAME="$ifname"
    fi
fi
export SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION="${SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION:-0}"
# asyncrl's hook (launcher/sglang_hooks, mounted by compose): SGLang's weight-update group gets a
# bounded timeout instead of torch's 30 minutes (issue 66 N7; engines.weight_group_timeout_s,
# which must exceed sync.broadcast_timeout_s)
ENGINE_WEIGHT_GROUP_TIMEOUT_S="${ENGINE_WEIGHT_GROUP_TIMEOUT_S:-360}"
if [[ -z "${ENGINE_HOOK_DIR:-}" ]]; then  # compose's mount, else this checkout's (engine.sh run from a clone)
    for candidate in /opt/asyncrl/sglang_hooks "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/../../launcher/sglang_hooks"; do
        if [[ -r "$candidate/sitecustomize.py" ]]; then
            ENGINE_HOOK_DIR="$(cd "$candidate" && pwd)"
            break
        fi
    done
fi
ENGINE_HOOK_DIR="${ENGINE_HOOK_DIR:-/opt/asyncrl/sglang_hooks}"
if [[ ! -r "$ENGINE_HOOK_DIR/sitecustomize.py" ]]; then
    echo "engine.sh: asyncrl's SGLang hook is missing: $ENGINE_HOOK_DIR/sitecustomize.py (mount launcher/sglang_hooks there)" >&2
    exit 2
fi
export ASYNCRL_WEIGHT_GROUP_TIMEOUT_S="$ENGINE_WEIGHT_GROUP_TIMEOUT_S"
export PYTHONPATH="$ENGINE_HOOK_DIR${PYTHONPATH:+:$PYTHONPATH}"

# the key in a private file (mkdtemp: 0700; the file 0600), JSON-quoted (JSON is YAML)
secrets_dir=$(mktemp -d -t asyncrl-engine-XXXXXX)
(umask 077 && ENGINE_API_KEY="$ENGINE_API_KEY" \
    python3 -c 'import json, os; print(json.dumps({"api-key": os.environ["ENGINE_API_KEY"]}))' > "$secrets_dir/secrets.yaml")
unset ENGINE_API_KEY

read -r -a extra <<< "${ENGINE_EXTRA_ARGS:-}"
cmd=(python3 -m sglang.launch_server
     --model-path "$ENGINE_MODEL_PATH"
     --host "$ENGINE_HOST" --port "$port"
     --tp-size "$ENGINE_TP"
     --mem-fraction-static "$ENGINE_MEM_FRACTION"
     --enable-metrics
     --tool-call-parser "$ENGINE_TOOL_CALL_PARSER"
     --config "$secrets_dir/secrets.yaml"
     "${extra[@]}" "$@")

echo "engine.sh: slot $slot of $slots (CUDA_VISIBLE_DEVICES=$visible), listening on $ENGINE_HOST:$port" \
     "(weight-group interface: ${NCCL_SOCKET_IFNAME:-any})" \
     "(weight-group timeout: ${ASYNCRL_WEIGHT_GROUP_TIMEOUT_S} s, asyncrl's hook: $ENGINE_HOOK_DIR)" >&2
if [[ "${ENGINE_DRY_RUN:-0}" == "1" ]]; then
    printf '%s\n' "${cmd[@]}"
    exec sleep "${ENGINE_DRY_RUN_HOLD_S:-0}"
fi
exec "${cmd[@]}"
