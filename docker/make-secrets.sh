#!/usr/bin/env bash
# Write the secret files compose.yaml mounts (its top-level `secrets:`), one per secret:
#
#   docker/make-secrets.sh [DIR]        DIR: $SECRETS_DIR, else ./secrets; then SECRETS_DIR=DIR in .env
#
# - a file that exists is kept: running it again never rotates a secret by accident (delete the
#   file and restart the services that read it to rotate one);
# - a missing one gets the value of its upper-case variable when that is set and 16+ characters
#   long (a shorter one is refused: the names are generic; ADMIN_TOKEN for admin_token: `set -a; . ./old.env; set +a; docker/make-secrets.sh` moves the secrets of an
#   .env of an older release into files), else 24 random bytes in hex (the NATS passwords
#   start with "nats-": nats.conf takes them as bare values, which must start with a letter);
# - the directory is 0700 (only its owner on the host reads it), each file 0444 without a
#   trailing newline: Docker bind-mounts it into the containers, whose users (uid 10001, nats,
#   Grafana's 472) must read it.
# The admin token must differ from the API token (the rollout service refuses to start
# otherwise): random values do.
set -euo pipefail
NAMES=(admin_token api_token sync_token status_token engine_api_key
       nats_rollout_password nats_trainer_password nats_sys_password grafana_admin_password)
dir="${1:-${SECRETS_DIR:-./secrets}}"
(umask 077 && mkdir -p "$dir")
chmod 700 "$dir"
for name in "${NAMES[@]}"; do
    file="$dir/$name"
    if [[ -e "$file" ]]; then
        echo "make-secrets: kept $file"
        continue
    fi
    var="${name^^}"
    value="${!var:-}"
    if [[ -n "$value" && ${#value} -lt 16 ]]; then
        # the names are generic (API_TOKEN, ADMIN_TOKEN, ...): a shell may hold one set for
        # something else; a short value is refused rather than written as a weak secret
        echo "make-secrets: \$$var is set but shorter than 16 characters: refusing to write it as $name" \
             "(unset it for a random value, or set a strong one)" >&2
        exit 1
    fi
    [[ -n "$value" ]] && echo "make-secrets: $name from \$$var"
    if [[ -z "$value" ]]; then
        value="$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')"
        [[ "$name" == nats_* ]] && value="nats-$value"
    fi
    (umask 077 && printf '%s' "$value" > "$file")
    chmod 444 "$file"
    echo "make-secrets: wrote $file"
done
