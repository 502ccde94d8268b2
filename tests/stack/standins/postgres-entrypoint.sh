#!/usr/bin/env bash
# First start: initdb (UTF-8, as the official image) with POSTGRES_USER/POSTGRES_PASSWORD and
# create POSTGRES_DB; then serve.
set -euo pipefail
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s' "${POSTGRES_PASSWORD:?}" > "$pwfile"
  initdb --username="${POSTGRES_USER:-postgres}" --pwfile="$pwfile" --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8 \
    --auth-local=trust -D "$PGDATA" > /dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start > /dev/null
  if [ "${POSTGRES_DB:-}" ] && [ "$POSTGRES_DB" != postgres ]; then
    createdb --username="${POSTGRES_USER:-postgres}" "$POSTGRES_DB"
  fi
  pg_ctl -D "$PGDATA" -m fast -w stop > /dev/null
fi
exec postgres -D "$PGDATA" -c listen_addresses='*'
