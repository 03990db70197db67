#!/bin/bash
# The pdserve image's entry point (/usr/local/bin/pdserve-entrypoint): runs its arguments (a
# service, `pdserve ...`, a shell) after settling two things no command line should carry.
#
# * PDSERVE_INSECURE=1 turns security off, loudly: every TLS, internal-token and API-key
#   variable is dropped and a banner on stderr says what that means. Only
#   docker-compose.insecure.yml and the Kubernetes dev overlay set it.
# * The Redis password comes from a file: every "{password}" in PDSERVE_REDIS_URL is replaced
#   by the contents of PDSERVE_REDIS_PASSWORD_FILE, so the password is on no command line and
#   in no compose file. REDIS_URL (what `pdserve status` reads) gets the same URL unless set.
#
# `docker compose exec SERVICE pdserve-entrypoint CMD...` runs CMD the same way (exec does not go
# through the entry point).
set -euo pipefail

if [ "${PDSERVE_INSECURE:-0}" = 1 ]; then
  for name in $(compgen -e); do
    case $name in
      PDSERVE_TLS_* | PDSERVE_ROUTER_TLS_* | PDSERVE_INTERNAL_TOKEN* | PDSERVE_API_KEYS | \
        PDSERVE_REDIS_PASSWORD_FILE) unset "$name" ;;
    esac
  done
  {
    echo "pdserve: ***********************************************************************"
    echo "pdserve: * INSECURE (PDSERVE_INSECURE=1): plaintext gRPC and HTTP, no API keys, no"
    echo "pdserve: * internal token, Redis without a password: anyone who reaches a port can"
    echo "pdserve: * call it. For local hacking only; see docs/deploy.md to run it secured."
    echo "pdserve: ***********************************************************************"
  } >&2
fi

url=${PDSERVE_REDIS_URL:-}
if [[ $url == *"{password}"* ]]; then
  file=${PDSERVE_REDIS_PASSWORD_FILE:-}
  if [ -z "$file" ] || [ ! -r "$file" ]; then
    echo "pdserve-entrypoint: PDSERVE_REDIS_URL has {password} but PDSERVE_REDIS_PASSWORD_FILE" \
      "(${file:-unset}) is not a readable file" >&2
    exit 64
  fi
  password=$(<"$file")
  password=${password%%[[:space:]]*}
  [ -n "$password" ] || { echo "pdserve-entrypoint: $file is empty" >&2; exit 64; }
  export PDSERVE_REDIS_URL=${url//\{password\}/"$password"}
fi
if [ -n "${PDSERVE_REDIS_URL:-}" ] && [ -z "${REDIS_URL:-}" ]; then
  export REDIS_URL=$PDSERVE_REDIS_URL
fi

[ "$#" -gt 0 ] || set -- pdserve --help
exec "$@"
