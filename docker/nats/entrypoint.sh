#!/bin/sh
# Entry point of the nats service (compose.yaml): each user's password from its Docker secret
# file (/run/secrets/nats_<user>_password, docker/make-secrets.sh) into the variable
# docker/nats/nats.conf substitutes, then nats-server with the arguments given. The passwords
# are then in nats-server's own environment only, not in the container's configuration
# (`docker inspect` shows none). NATS_SECRETS_DIR (default /run/secrets) moves the files
# (tests/deploy/test_stack.py runs this script outside a container).
set -eu
dir="${NATS_SECRETS_DIR:-/run/secrets}"
for user in rollout trainer sys; do
    file="$dir/nats_${user}_password"
    if [ ! -r "$file" ]; then
        echo "nats entrypoint: cannot read $file (the nats_${user}_password secret)" >&2
        exit 2
    fi
done
NATS_ROLLOUT_PASSWORD="$(cat "$dir/nats_rollout_password")"
NATS_TRAINER_PASSWORD="$(cat "$dir/nats_trainer_password")"
NATS_SYS_PASSWORD="$(cat "$dir/nats_sys_password")"
export NATS_ROLLOUT_PASSWORD NATS_TRAINER_PASSWORD NATS_SYS_PASSWORD
exec nats-server "$@"
