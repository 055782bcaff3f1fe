#!/bin/sh
# Starts Envoy on a config whose plugin hash_key is the placeholder __HASH_KEY__ (envoy/gen
# --hash-key-placeholder, e.g. envoy/compose.yaml), with a fresh random key written in first:
#
#   envoy-start.sh TEMPLATE RENDERED [envoy args...]     (runs: envoy -c RENDERED envoy args...)
#
# For ONE replica (docker-compose.yml): the key only has to live as long as the prefix index, and a
# restart empties the index anyway. Several replicas that share an index need one key: render their
# configs from one secret instead (envoy/gen --hash-key-file, or the StatefulSet's init container).
# The key is never committed or put on a command line; RENDERED is written readable by its owner only.
# ENVOY names the binary (default: envoy on PATH).
set -eu
template=$1
rendered=$2
shift 2
# 32 random bytes as 64 hex characters (od: in every base image, unlike openssl or xxd)
key=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
if [ "${#key}" -ne 64 ]; then
  echo "envoy-start.sh: could not read a random key from /dev/urandom" >&2
  exit 1
fi
grep -q '"hash_key": "__HASH_KEY__"' "$template" || {
  echo "envoy-start.sh: $template has no hash_key placeholder __HASH_KEY__ (envoy/gen --hash-key-placeholder)" >&2
  exit 1
}
umask 077
sed "s/\"hash_key\": \"__HASH_KEY__\"/\"hash_key\": \"$key\"/" "$template" > "$rendered"
exec "${ENVOY:-envoy}" -c "$rendered" "$@"
