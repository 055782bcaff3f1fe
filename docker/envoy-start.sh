#!/bin/sh
# Starts Envoy on a config whose secrets are placeholders (envoy/gen --hash-key-placeholder
# [--peer-secret-placeholder], e.g. envoy/compose.yaml), with the secrets written in first:
#
#   envoy-start.sh TEMPLATE RENDERED [envoy args...]     (runs: envoy -c RENDERED envoy args...)
#
# HASH_KEY_FILE: a file holding the plugin hash_key. Unset: a fresh random key, enough for ONE
#   replica (docker-compose.yml): the key only has to live as long as the prefix index, and a
#   restart empties the index anyway. Replicas that share an index need one key from one secret.
# PEER_SECRET_FILE: a file holding the shared peer secret (needed when TEMPLATE has
#   __PREFIX_ROUTER_PEER_SECRET__).
# FILL_SECRETS: docker/fill-secrets.awk (default: next to this script), which does the replacing.
# ENVOY: the binary (default: envoy on PATH).
#
# Secrets go from file to file: never on a command line (argv is readable by every process), in
# the environment or in a log. RENDERED and the generated key are readable by their owner only.
# Any placeholder left (a secret file missing or unusable) stops the start with its name.
set -eu
template=$1
rendered=$2
shift 2
fill=${FILL_SECRETS:-$(dirname "$0")/fill-secrets.awk}
umask 077
key_file=${HASH_KEY_FILE:-}
if [ -z "$key_file" ]; then
  key_file=$rendered.key
  # 32 random bytes as 64 hex characters (od: in every base image, unlike openssl or xxd)
  od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$key_file"
  if [ "$(wc -c < "$key_file")" -ne 64 ]; then
    echo "envoy-start.sh: could not read a random key from /dev/urandom" >&2
    exit 1
  fi
fi
if ! awk -v hash_key_file="$key_file" -v peer_secret_file="${PEER_SECRET_FILE:-}" -f "$fill" \
    "$template" > "$rendered.tmp"; then
  rm -f "$rendered.tmp"
  echo "envoy-start.sh: $template: could not fill in its secrets (above); Envoy not started" >&2
  exit 1
fi
mv "$rendered.tmp" "$rendered"
[ -n "${HASH_KEY_FILE:-}" ] || rm -f "$key_file"
exec "${ENVOY:-envoy}" -c "$rendered" "$@"
