#!/usr/bin/env bash
# The stand-in Airflow image's entrypoint: what the official image's does that burstcv relies on.
set -euo pipefail
# An arbitrary uid (AIRFLOW_UID) with group 0: give it a passwd entry, home /home/airflow.
if ! whoami > /dev/null 2>&1; then
  if [ -w /etc/passwd ]; then
    echo "default:x:$(id -u):0:default user:${AIRFLOW_USER_HOME_DIR}:/sbin/nologin" >> /etc/passwd
  fi
  export HOME="${AIRFLOW_USER_HOME_DIR}"
fi
case "${1:-}" in
  bash | python | python3 | "") exec "$@" ;;
esac
exec airflow "$@"
