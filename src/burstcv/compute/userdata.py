"""Render the bash user-data that turns a fresh GPU instance into one training run, then off.

The script's order is the safety argument: arm a ``shutdown -h +N`` watchdog before anything
else, install the package bundle, watch for a spot interruption notice, run
``burstcv train --job <uri>``, and on every exit path (the EXIT trap) make sure DONE or FAILED
exists, upload the log and ``shutdown -h now``. With ``InstanceInitiatedShutdownBehavior``
set to ``terminate`` each shutdown destroys the instance, so nothing idles after the job.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass

# Minutes the watchdog allows beyond the training budget: bootstrap (bundle install) before
# training starts and the final upload after it ends.
DEFAULT_MARGIN_MIN = 5

# IMDSv2 endpoints the spot poller uses (hop limit 1 is enough: it runs on the host).
IMDS_TOKEN_URL = "http://169.254.169.254/latest/api/token"
SPOT_ACTION_URL = "http://169.254.169.254/latest/meta-data/spot/instance-action"
SPOT_POLL_INTERVAL_S = 5

# The config block every render fills in; the harness in tests reads JOB_URI from it.
CONFIG_KEYS = ("RUN_ID", "JOB_URI", "JOB_DIR", "BUNDLE_URI", "PYTHON", "WATCHDOG_MIN")


@dataclass(frozen=True)
class UserDataSpec:
    """Describe what one training instance runs and within how long."""

    run_id: str
    job_uri: str  # s3://…/runs/<run_id>/job/job.json
    bundle_uri: str  # s3://… a burstcv wheel, or a .tar.gz wheelhouse holding one
    time_budget_s: int
    margin_min: int = DEFAULT_MARGIN_MIN
    python: str = "python3"  # interpreter on the AMI (3.11); its site-packages hold CUDA torch

    @property
    def job_dir(self) -> str:
        """Return the folder of job.json, where DONE / FAILED and the logs go."""
        return self.job_uri.rsplit("/", 1)[0]


def watchdog_minutes(time_budget_s: int, margin_min: int = DEFAULT_MARGIN_MIN) -> int:
    """Return the ``shutdown -h +N`` minutes for a budget: ceil(budget / 60) plus the margin."""
    if time_budget_s <= 0:
        raise ValueError(f"time_budget_s must be positive, got {time_budget_s}")
    if margin_min < 0:
        raise ValueError(f"margin_min must be >= 0, got {margin_min}")
    return math.ceil(time_budget_s / 60) + margin_min


def max_instance_seconds(time_budget_s: int, margin_min: int = DEFAULT_MARGIN_MIN) -> int:
    """Return the longest an instance can live under the watchdog (for expiry tags and cost)."""
    return watchdog_minutes(time_budget_s, margin_min) * 60


# The body after the watchdog and the config block. Every `$` here is bash's, not Python's.
_BODY = r"""
# cloud-init runs this with a clean environment; the overrides exist for the test harness.
WORK="${BURSTCV_WORK_DIR:-/opt/burstcv}"
LOG="${BURSTCV_LOG:-/var/log/burstcv-bootstrap.log}"
mkdir -p "$WORK"
exec > >(tee -a "$LOG") 2>&1
echo "burstcv: run $RUN_ID, job $JOB_URI, watchdog +${WATCHDOG_MIN} min"

imds_token() {
  curl -sf -X PUT "__IMDS_TOKEN_URL__" -H "X-aws-ec2-metadata-token-ttl-seconds: 300"
}

instance_id() {
  local token
  token=$(imds_token) || { echo unknown; return 0; }
  curl -sf -H "X-aws-ec2-metadata-token: $token" \
    http://169.254.169.254/latest/meta-data/instance-id || echo unknown
}

marker_exists() {
  aws s3 ls "$JOB_DIR/$1" > /dev/null 2>&1
}

# Runs on every exit, success or failure: a marker must exist, the log goes up, the box goes down.
finish() {
  local rc=$?
  trap - EXIT
  set +e  # best effort from here on: every step may fail, the shutdown must still run
  [ -n "${POLLER_PID:-}" ] && kill "$POLLER_PID" 2> /dev/null
  if ! marker_exists DONE && ! marker_exists FAILED; then
    local reason="exit code $rc without a DONE or FAILED marker"
    [ -f "$WORK/spot-notice" ] && reason="spot interruption (exit code $rc)"
    echo "burstcv: writing FAILED: $reason"
    printf '{"reason": "%s", "exit_code": %d, "stage": "bootstrap", "run_id": "%s"}\n' \
      "$reason" "$rc" "$RUN_ID" | aws s3 cp - "$JOB_DIR/FAILED"
  fi
  aws s3 cp "$LOG" "$JOB_DIR/logs/$(instance_id).log"
  echo "burstcv: done (exit code $rc); shutting down now"
  shutdown -h now
}
trap finish EXIT
trap 'exit 143' TERM INT HUP

# Spot interruption: ask training to checkpoint (SIGTERM), or end the bootstrap if it has not
# started yet. The EXIT trap then records FAILED and shuts down before AWS reclaims the box.
spot_poller() {
  local token
  while sleep __SPOT_POLL_INTERVAL_S__; do
    token=$(imds_token) || continue
    if curl -sf -H "X-aws-ec2-metadata-token: $token" "__SPOT_ACTION_URL__" > /dev/null; then
      echo "burstcv: spot interruption notice"
      touch "$WORK/spot-notice"
      if [ -s "$WORK/train.pid" ]; then
        kill -TERM "$(cat "$WORK/train.pid")"
      else
        kill -TERM "$$"
      fi
      return 0
    fi
  done
}

# Install the package bundle from the artifact store into a venv that sees the AMI's torch.
aws s3 cp "$BUNDLE_URI" "$WORK/bundle/"
"$PYTHON" -m venv --system-site-packages "$WORK/venv"
case "$BUNDLE_URI" in
  *.tar.gz | *.tgz)
    tar -xzf "$WORK/bundle/$(basename "$BUNDLE_URI")" -C "$WORK/bundle"
    "$WORK/venv/bin/pip" install --no-index --find-links "$WORK/bundle" --find-links \
      "$WORK/bundle/wheelhouse" burstcv
    ;;
  *)
    "$WORK/venv/bin/pip" install "$WORK/bundle/$(basename "$BUNDLE_URI")"
    ;;
esac

spot_poller &
POLLER_PID=$!

"$WORK/venv/bin/burstcv" train --job "$JOB_URI" &
echo $! > "$WORK/train.pid"
set +e
wait "$(cat "$WORK/train.pid")"
TRAIN_RC=$?
set -e
echo "burstcv: training exited with $TRAIN_RC"
exit "$TRAIN_RC"
"""


def render_user_data(spec: UserDataSpec) -> str:
    """Return the bash user-data script for one training instance."""
    if not spec.job_uri.startswith("s3://"):
        raise ValueError(f"an EC2 instance reads its job from S3; got job_uri {spec.job_uri!r}")
    if not spec.bundle_uri.startswith("s3://"):
        raise ValueError(f"the package bundle must be an s3:// URI; got {spec.bundle_uri!r}")
    minutes = watchdog_minutes(spec.time_budget_s, spec.margin_min)
    header = [
        "#!/bin/bash",
        f"# burstcv training instance for run {_comment_safe(spec.run_id)}",
        "# (rendered by burstcv.compute.userdata; do not edit)",
        "set -Eeuo pipefail",
        "# Watchdog first: whatever happens below, the box powers off (and, with",
        "# InstanceInitiatedShutdownBehavior=terminate, is destroyed) when the budget is spent.",
        f'shutdown -h +{minutes} "burstcv watchdog: time budget spent" || poweroff',
        "",
    ]
    values = {
        "RUN_ID": spec.run_id,
        "JOB_URI": spec.job_uri,
        "JOB_DIR": spec.job_dir,
        "BUNDLE_URI": spec.bundle_uri,
        "PYTHON": spec.python,
        "WATCHDOG_MIN": str(minutes),
    }
    config = [f"readonly {key}={shlex.quote(values[key])}" for key in CONFIG_KEYS]
    body = (
        _BODY.replace("__IMDS_TOKEN_URL__", IMDS_TOKEN_URL)
        .replace("__SPOT_ACTION_URL__", SPOT_ACTION_URL)
        .replace("__SPOT_POLL_INTERVAL_S__", str(SPOT_POLL_INTERVAL_S))
    )
    return "\n".join(header + config) + "\n" + body


def parse_config(script: str) -> dict[str, str]:
    """Return the config block of a rendered script (what the instance will run)."""
    found: dict[str, str] = {}
    for line in script.splitlines():
        if not line.startswith("readonly "):
            continue
        key, _, raw = line.removeprefix("readonly ").partition("=")
        if key in CONFIG_KEYS:
            parts = shlex.split(raw)
            found[key] = parts[0] if parts else ""
    return found


def _comment_safe(text: str) -> str:
    return text.replace("\n", " ").replace("\r", " ")
