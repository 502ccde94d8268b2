"""Render the bash user-data that turns a fresh GPU instance into one training attempt, then off.

The script's order is the safety argument: a ``shutdown -h +N`` watchdog from the run's
deadline before anything else; the box's identity and region from IMDSv2; an EXIT trap that
makes sure the attempt has DONE or FAILED, uploads the log and powers off (destroying the box);
the spot-notice poller and the log shipper; then the wheel (checked against its sha256) and
its wheelhouse (every wheel it needs, beside it: no package index), ``burstcv preflight`` and
``burstcv train``. S3 goes through boto3 where a Python of the box has it (a helper the
script writes), else through the AWS CLI v2 (Amazon Linux 2023's ``python3`` has no boto3),
read by its documented exit codes; from the install on, through the wheel's own boto3.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from datetime import datetime, timedelta

from burstcv.cost.model import outlives_deadline_s
from burstcv.training.job import attempt_dir
from burstcv.training.preflight import SUPPORTED_PYTHON

# Minutes the watchdog allows beyond the run's deadline: the final checkpoint, marker and log
# upload after training stops at the deadline.
DEFAULT_MARGIN_MIN = 5
DEFAULT_LOG_EVERY_S = 30  # how often the box's log reaches the artifact store while it runs

IMDS = "http://169.254.169.254/latest"
# torchrun's c10d rendezvous on the box of launch index 0 (its default port); the run's
# security group admits it from the run's own boxes only.
RENDEZVOUS_PORT = 29400
RENDEZVOUS_WAIT_S = 900  # how long a box waits for launch index 0's address (it boots alike)
SPOT_POLL_INTERVAL_S = 5


@dataclass(frozen=True)
class UserDataSpec:
    """Describe what one training instance runs, for which attempt, until when."""

    run_id: str
    job_uri: str  # s3://…/runs/<run_id>/job/job.json
    attempt: int
    wheel_uri: str  # s3://…/runtime/<sha256>/burstcv_train-….whl
    wheel_sha256: str
    deadline_at: datetime  # the run's absolute deadline (UTC), shared by every attempt
    region: str  # used only if IMDS does not answer with the box's own region
    margin_min: int = DEFAULT_MARGIN_MIN
    python: str = "/opt/pytorch/bin/python"  # the AMI's PyTorch interpreter
    log_every_s: int = DEFAULT_LOG_EVERY_S
    num_nodes: int = 1  # boxes started together by one launch, training as one job


def expiry_of(deadline_at: datetime, margin_min: int = DEFAULT_MARGIN_MIN) -> datetime:
    """Return when the watchdog has ended any box of the run at the latest (the expiry tag)."""
    return deadline_at + timedelta(seconds=outlives_deadline_s(margin_min))


_SINGLE_TRAIN = r"""STAGE=train
BURSTCV_SHARD_CACHE_DIR="$WORK/shard-cache" \
  "$BURSTCV" train --job "$JOB_URI" --attempt "$ATTEMPT" &
"""

# Several boxes: this box's launch index and address (its node rank comes from torchrun).
_NODE_IDENTITY = r"""LAUNCH_INDEX=$(imds meta-data/ami-launch-index) || LAUNCH_INDEX=""
PRIVATE_IP=$(imds meta-data/local-ipv4) || PRIVATE_IP=""
stamp "launch index ${LAUNCH_INDEX:-?} of $NUM_NODES at ${PRIVATE_IP:-?}"
"""

# Several boxes: launch index 0 publishes its private address for this attempt, the others
# wait for it; then torchrun (c10d) on every box, one process per GPU (one on a CPU box).
_MULTI_TRAIN = r"""STAGE=rendezvous
[ -n "$LAUNCH_INDEX" ] && [ -n "$PRIVATE_IP" ] \
  || fail_final "the instance metadata gave no launch index or private address"
RENDEZVOUS_URI="$ATTEMPT_DIR/rendezvous/node-0-address"
if [ "$LAUNCH_INDEX" = 0 ]; then
  echo "$PRIVATE_IP" | s3 cp - "$RENDEZVOUS_URI"
  RENDEZVOUS_HOST="$PRIVATE_IP"
  IS_HOST=true
else
  waited=0
  until s3_object_exists "$RENDEZVOUS_URI"; do
    [ "$waited" -lt __RENDEZVOUS_WAIT_S__ ] \
      || fail_final "launch index 0 published no address in __RENDEZVOUS_WAIT_S__ s"
    sleep 2
    waited=$((waited + 2))
  done
  s3 cp "$RENDEZVOUS_URI" "$WORK/rendezvous-host"
  RENDEZVOUS_HOST=$(tr -d '[:space:]' < "$WORK/rendezvous-host")
  IS_HOST=false
fi
NPROC=$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')
stamp "rendezvous at $RENDEZVOUS_HOST:$RENDEZVOUS_PORT, launch index $LAUNCH_INDEX, $NPROC proc(s)"
STAGE=train
BURSTCV_SHARD_CACHE_DIR="$WORK/shard-cache" \
  "$PYTHON" -m torch.distributed.run --nnodes "$NUM_NODES" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$RENDEZVOUS_HOST:$RENDEZVOUS_PORT" \
  --rdzv-id "$RUN_ID-$ATTEMPT" \
  --rdzv-conf "is_host=$IS_HOST" --local-addr "$PRIVATE_IP" --max-restarts 0 \
  -m burstcv.training.entry train --job "$JOB_URI" --attempt "$ATTEMPT" &
"""

# What every box's script starts with, after its watchdog and config. Every `$` below is
# bash's; __NAME__ placeholders are filled in by the renders.
_PRELUDE = r"""
# Run by cloud-init as root; the overrides are for a sandbox.
WORK="${BURSTCV_WORK_DIR:-/opt/burstcv}"
LOG="${BURSTCV_LOG:-/var/log/burstcv-bootstrap.log}"
mkdir -p "$WORK"
exec > >(tee -a "$LOG") 2>&1
STAGE=bootstrap
stamp() { echo "burstcv: $(date -u +%Y-%m-%dT%H:%M:%S.%3NZ) $*"; }
stamp "__FIRST_STAMP__"

imds() {
  local token
  token=$(curl -sf -m 5 -X PUT "__IMDS__/api/token" \
    -H "X-aws-ec2-metadata-token-ttl-seconds: 300") || return 1
  curl -sf -m 5 -H "X-aws-ec2-metadata-token: $token" "__IMDS__/$1"
}
INSTANCE_ID=$(imds meta-data/instance-id) || INSTANCE_ID=unknown
INSTANCE_TYPE=$(imds meta-data/instance-type) || INSTANCE_TYPE=""
AWS_REGION=$(imds meta-data/placement/region) || AWS_REGION="$FALLBACK_REGION"
AWS_DEFAULT_REGION="$AWS_REGION"
export AWS_REGION AWS_DEFAULT_REGION
# IMDS may answer a busy box slowly: wait longer than botocore's 1 s, more than once.
AWS_METADATA_SERVICE_TIMEOUT=5
AWS_METADATA_SERVICE_NUM_ATTEMPTS=5
export AWS_METADATA_SERVICE_TIMEOUT AWS_METADATA_SERVICE_NUM_ATTEMPTS
stamp "instance $INSTANCE_ID ($INSTANCE_TYPE) in $AWS_REGION"
cat > "$WORK/s3io.py" << 'S3IO'
# burstcv box: S3 copies and existence checks through boto3.
import sys

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError


def split(uri):
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key


def run(command, *args):
    # An unreachable S3 fails in a minute.
    s3 = boto3.client("s3", config=Config(connect_timeout=10, retries={"max_attempts": 4}))
    if command == "exists":
        try:
            s3.head_object(Bucket=split(args[0])[0], Key=split(args[0])[1])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return 1
            raise
        return 0
    source, target = args
    if source.startswith("s3://"):
        s3.download_file(*split(source), target)
    elif source == "-":
        s3.put_object(Body=sys.stdin.buffer.read(), **dict(zip(("Bucket", "Key"), split(target))))
    else:
        s3.upload_file(source, *split(target))
    return 0


try:
    sys.exit(run(*sys.argv[1:]))
except Exception as exc:  # one line in the box's log, not a traceback
    print(f"s3: {' '.join(sys.argv[1:])}: {type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(2)
S3IO
S3PY=""
for candidate in "$PYTHON" python3; do
  if "$candidate" -c "import boto3" > /dev/null 2>&1; then
    S3PY=$(command -v "$candidate")
    break
  fi
done
if [ -z "$S3PY" ]; then
  # No boto3 yet (Amazon Linux 2023's python3, or a wrong interpreter setting): the AWS CLI.
  if command -v aws > /dev/null; then
    stamp "no Python with boto3 yet (tried $PYTHON and python3): S3 through the AWS CLI"
  else
    stamp "cannot reach S3: no Python with boto3 (tried $PYTHON and python3) and no AWS CLI; \
check the interpreter setting (BURSTCV_EC2_PYTHON or BURSTCV_EC2_SIZING_PYTHON)"
  fi
fi
s3() {  # s3 cp SRC DST (an s3:// URI, a file, or - for stdin) | s3 exists URI: 0, 1 (404), 2
  if [ -n "$S3PY" ]; then
    "$S3PY" "$WORK/s3io.py" "$@"
    return $?  # a bare return in the EXIT trap would give the exit code that started it
  fi
  local out rc=0 path=${2#s3://}
  if [ "$1" = exists ]; then
    out=$(aws s3api head-object --bucket "${path%%/*}" --key "${path#*/}" 2>&1 > /dev/null) \
      || rc=$?
    # AWS CLI v2: 254 is the service's error (a 404: no such key); 253 and 255, no answer.
    [ "$rc" = 254 ] && [[ "$out" == *"(404)"* ]] && return 1
  else
    out=$(aws s3 cp --quiet "$2" "$3" 2>&1) || rc=$?
  fi
  [ "$rc" = 0 ] && return 0
  out=$(tr -s '[:space:]' ' ' <<< "$out")
  out=${out# }
  echo "s3: $*: aws exit code $rc: ${out% }" >&2
  return 2
}

# HeadObject: GetObject (and ListBucket for a 404).
s3_object_exists() {
  s3 exists "$1" > /dev/null 2>&1
}
"""

# Every box, after the prelude; the __PARTS__ are what a training and a sizing box do differently.
_BOX = r"""
__SETUP__
# Runs on every exit: the attempt gets a marker, the log goes up, the box goes down.
finish() {
  local rc=$?
  trap - EXIT
  set +e  # best effort from here on: every step may fail, the shutdown must still run
  kill ${POLLER_PID:-} ${SHIPPER_PID:-} ${SIZE_PID:-} 2> /dev/null  # unquoted: those started
  if [ -n "${NO_S3:-}" ]; then  # neither a marker nor the log can get out: off at once
    shutdown -h now
    return
  fi
__ON_EXIT__
  stamp "done (exit code $rc); shutting down now"
  s3 cp "$LOG" "$LOG_URI"
  shutdown -h now
}
trap finish EXIT
trap 'exit 143' TERM INT HUP

# A failure no relaunch can fix: record it with its reason, then the trap powers off.
fail_final() {
  stamp "$STAGE failed: $1"
__RECORD_FAILURE__  exit 3
}

# S3 first: a box that cannot reach it says so (console log) and halts.
for try in 1 2 3; do
  out=$(s3 exists "__PROBE_URI__" 2>&1) && break
  [ "$?" = 1 ] && break
  [ "$try" = 3 ] && stamp "cannot reach S3: $out" && NO_S3=1 && exit 4
  sleep 10
done
s3 cp "$LOG" "$LOG_URI" || true
__SPOT_POLLER__
# The log ships while the box runs: a hard death leaves its last lines.
ship_log() {
  while sleep "$LOG_EVERY_S"; do s3 cp "$LOG" "$LOG_URI" || true; done
}
ship_log &
SHIPPER_PID=$!
__PYTHON_CHECK__
STAGE=install
stamp "installing $WHEEL_URI"
WHEEL="$WORK/$(basename "$WHEEL_URI")"
s3 cp "$WHEEL_URI" "$WHEEL"
echo "$WHEEL_SHA256  $WHEEL" | sha256sum -c --quiet - \
  || fail_final "the __WHAT__ wheel at $WHEEL_URI does not match its sha256 $WHEEL_SHA256"
"$PYTHON" -m pip --version > /dev/null 2>&1 || "$PYTHON" -m ensurepip --upgrade > /dev/null
# The wheelhouse of this Python and machine, beside the wheel: no package index needed.
TAG=$("$PYTHON" -c 'import platform, sys; print("cp%d%d-%s" % (*sys.version_info[:2], \
platform.machine()))')
WHEELHOUSE_URI="${WHEEL_URI%/*}/wheelhouse/$TAG.tar"
FROM=()
if s3_object_exists "$WHEELHOUSE_URI"; then
  mkdir -p "$WORK/wheelhouse"
  s3 cp "$WHEELHOUSE_URI" "$WORK/wheelhouse.tar"
  tar -xf "$WORK/wheelhouse.tar" -C "$WORK/wheelhouse"
  (cd "$WORK/wheelhouse" && sha256sum -c --quiet SHA256SUMS) \
    || fail_final "the wheelhouse at $WHEELHOUSE_URI does not match its SHA256SUMS"
  FROM=(--no-index --find-links "$WORK/wheelhouse")
else
  stamp "no wheelhouse for $TAG at $WHEELHOUSE_URI: pip uses the package index"
fi
# Into the AMI's environment: its torch reused, never resolved (a sizing box has none).
PIP_BREAK_SYSTEM_PACKAGES=1 "$PYTHON" -m pip install --quiet --no-input \
  --disable-pip-version-check --no-warn-script-location "${FROM[@]}" "$WHEEL"
BURSTCV="$(dirname "$(command -v "$PYTHON")")/__ENTRY__"
[ -x "$BURSTCV" ] || BURSTCV=__ENTRY__
# boto3 came with the wheel: S3 through this Python from here on.
"$PYTHON" -c "import boto3" 2> /dev/null && S3PY=$(command -v "$PYTHON")
stamp "installed${FROM[*]:+ from the wheelhouse ($TAG)}"
__WORK__"""

# A training box's parts of _BOX.
_TRAIN_SETUP = r"""LOG_URI="$ATTEMPT_DIR/logs/$INSTANCE_ID.log"
__NODE_IDENTITY__
write_failed() {  # stage, resumable (true|false), reason, exit code
  local doc='{"schema_version": 1, "stage": "%s", "resumable": %s, "reason": "%s", '
  doc+='"attempt": %s, "exit_code": %d, "instance_id": "%s"}\n'
  # shellcheck disable=SC2059
  printf "$doc" "$1" "$2" "${3//\"/\'}" "$ATTEMPT" "$4" "$INSTANCE_ID" \
    | s3 cp - "$ATTEMPT_DIR/FAILED"
}
"""
_TRAIN_ON_EXIT = r"""  if [ -n "${LAUNCH_INDEX:-}" ] && [ "$STAGE" = train ]; then
    stamp "training ended with exit code $rc; its ranks wrote their markers"
  elif ! s3_object_exists "$ATTEMPT_DIR/DONE" && ! s3_object_exists "$ATTEMPT_DIR/FAILED"; then
    if [ -f "$WORK/spot-notice" ]; then
      stamp "writing FAILED: spot interruption during $STAGE"
      write_failed "$STAGE" true "spot interruption during $STAGE (exit code $rc)" "$rc"
    else
      stamp "writing FAILED: $STAGE ended with exit code $rc and no marker"
      write_failed "$STAGE" false \
        "$STAGE ended with exit code $rc and no DONE or FAILED marker; see $LOG_URI" "$rc"
    fi
  fi"""
_SPOT_POLLER = r"""
# Spot notice (looked for at once, then every few s): SIGTERM training to checkpoint, or
# end the bootstrap; the attempt's FAILED is resumable.
spot_poller() {
  while true; do
    if imds meta-data/spot/instance-action > /dev/null; then
      stamp "spot interruption notice"
      touch "$WORK/spot-notice"
      if [ -s "$WORK/train.pid" ]; then
        kill -TERM "$(cat "$WORK/train.pid")"
      else
        kill -TERM "$$"
      fi
      return 0
    fi
    sleep __SPOT_POLL_INTERVAL_S__
  done
}
spot_poller &
POLLER_PID=$!
"""
_TRAIN_PYTHON = r"""
STAGE=preflight
PY_CHECK='import sys; sys.exit(not (__PY_MIN__ <= sys.version_info[:2] < __PY_MAX__))'
if ! "$PYTHON" -c "$PY_CHECK" 2> /dev/null; then
  found=$("$PYTHON" --version 2>&1) || found="no Python at $PYTHON"
  fail_final "$found: burstcv training needs Python __PY_RANGE__; set BURSTCV_EC2_PYTHON to \
the AMI's PyTorch interpreter, or BURSTCV_EC2_AMI to a PyTorch Deep Learning AMI"
fi
"""
_TRAIN_WORK = r"""
STAGE=preflight
"$BURSTCV" preflight --job "$JOB_URI" --attempt "$ATTEMPT" --instance-type "$INSTANCE_TYPE"
stamp "preflight passed"

# A notice seen before training starts ends the attempt here (resumable), not mid-launch.
[ -f "$WORK/spot-notice" ] && exit 143
__TRAIN__echo $! > "$WORK/train.pid"
set +e
wait "$(cat "$WORK/train.pid")"
TRAIN_RC=$?
set -e
stamp "training exited with $TRAIN_RC"
exit "$TRAIN_RC"
"""


def render_user_data(spec: UserDataSpec) -> str:
    """Return the bash user-data script for one training attempt."""
    if not spec.job_uri.startswith("s3://"):
        raise ValueError(f"an EC2 instance reads its job from S3; got job_uri {spec.job_uri!r}")
    if not spec.wheel_uri.startswith("s3://"):
        raise ValueError(f"the training wheel must be an s3:// URI; got {spec.wheel_uri!r}")
    config = {
        "JOB_URI": spec.job_uri,
        "ATTEMPT": str(spec.attempt),
        "ATTEMPT_DIR": attempt_dir(spec.job_uri.rsplit("/", 1)[0], spec.attempt),
    }
    multi = spec.num_nodes > 1
    if multi:
        config["NUM_NODES"] = str(int(spec.num_nodes))
        config["RENDEZVOUS_PORT"] = str(RENDEZVOUS_PORT)
    low, high = SUPPORTED_PYTHON
    parts = {
        "__FIRST_STAMP__": "run $RUN_ID attempt $ATTEMPT, job $JOB_URI",
        "__SETUP__": _TRAIN_SETUP,
        "__NODE_IDENTITY__": _NODE_IDENTITY if multi else "",
        "__ON_EXIT__": _TRAIN_ON_EXIT,
        "__RECORD_FAILURE__": '  write_failed "$STAGE" false "$1" 3\n',
        "__PROBE_URI__": "$JOB_URI",
        "__SPOT_POLLER__": _SPOT_POLLER,
        "__PYTHON_CHECK__": _TRAIN_PYTHON,
        "__WHAT__": "training",
        "__ENTRY__": "burstcv",
        "__WORK__": _TRAIN_WORK,
        "__TRAIN__": _MULTI_TRAIN if multi else _SINGLE_TRAIN,
        "__RENDEZVOUS_WAIT_S__": str(RENDEZVOUS_WAIT_S),
        "__SPOT_POLL_INTERVAL_S__": str(SPOT_POLL_INTERVAL_S),
        "__PY_MIN__": repr(tuple(low)),
        "__PY_MAX__": repr(tuple(high)),
        "__PY_RANGE__": f"{low[0]}.{low[1]}-{high[0]}.{high[1] - 1}",
    }
    what = f"training instance for run {_comment_safe(spec.run_id)}, attempt {spec.attempt}"
    return _render(what, spec, config, parts)


def _render(
    what: str, spec: UserDataSpec | SizingBoxSpec, config: dict[str, str], parts: dict[str, str]
) -> str:
    """Return a box's script: the watchdog, the config block (``config`` and what every box
    has), the prelude and ``_BOX`` with ``parts`` filled in (in order: a part may hold the
    placeholders of a later one)."""
    if len(spec.wheel_sha256) != 64:
        raise ValueError(f"wheel_sha256 must be a sha256 hex digest, got {spec.wheel_sha256!r}")
    if spec.deadline_at.tzinfo is None:
        raise ValueError("deadline_at must be timezone-aware (UTC)")
    config = {
        "RUN_ID": spec.run_id,
        **config,
        "WHEEL_URI": spec.wheel_uri,
        "WHEEL_SHA256": spec.wheel_sha256,
        "PYTHON": spec.python,
        "FALLBACK_REGION": spec.region,
        "LOG_EVERY_S": str(int(spec.log_every_s)),
    }
    body = _PRELUDE + _BOX
    for placeholder, text in {**parts, "__IMDS__": IMDS}.items():
        body = body.replace(placeholder, text)
    # The comments stay here: EC2 takes 16 KB of user data.
    body = "\n".join(line for line in body.split("\n") if not _COMMENT.match(line))
    deadline, margin = int(spec.deadline_at.timestamp()), int(spec.margin_min)
    header = [
        "#!/bin/bash",
        f"# burstcv {what}",
        "# (rendered by burstcv.compute.userdata; do not edit)",
        "set -Eeuo pipefail",
        "# Watchdog first: whatever happens below, the box powers off (and, with",
        "# InstanceInitiatedShutdownBehavior=terminate, is destroyed) when the run's time is up:",
        f"# the deadline ({spec.deadline_at.isoformat()}) plus {margin} min for the last upload.",
        f"WATCHDOG_MIN=$(( ({deadline} - $(date +%s) + 59) / 60 + {margin} ))",
        f'[ "$WATCHDOG_MIN" -ge {max(1, margin)} ] || WATCHDOG_MIN={max(1, margin)}',
        'shutdown -h "+$WATCHDOG_MIN" "burstcv watchdog: the run\'s time is up" || poweroff',
        "",
    ]
    lines = header + [f"readonly {key}={shlex.quote(value)}" for key, value in config.items()]
    return "\n".join(lines) + "\n" + body


@dataclass(frozen=True)
class SizingBoxSpec:
    """Describe what one sizing box measures, and until when it may live."""

    run_id: str  # the sizing box's own run key (<run key>.size-<type>)
    instance_type: str  # the candidate type the box was launched as
    model_uri: str  # s3://… the model folder (model.json and its ONNX file)
    requests_uri: str  # s3://… bench/sizing/requests/
    out_uri: str  # s3://… bench/sizing/boxes/<type>.json
    log_uri: str  # s3://… where the box's log goes
    wheel_uri: str  # s3://…/runtime/<sha256>/burstcv_size-….whl
    wheel_sha256: str
    latency_slo_ms: float
    step_s: float
    deadline_at: datetime  # the sizing's absolute deadline (UTC)
    region: str  # used only if IMDS does not answer with the box's own region
    margin_min: int = 2
    python: str = "python3.11"  # Amazon Linux 2023's; installed with dnf when missing
    log_every_s: int = DEFAULT_LOG_EVERY_S


# A sizing box's parts of _BOX: no marker but its figures; the log goes up on every exit.
_SIZING_PYTHON = r"""
STAGE=python
PY_CHECK='import sys; sys.exit(sys.version_info[:2] < (3, 11))'
if ! "$PYTHON" -c "$PY_CHECK" 2> /dev/null && command -v dnf > /dev/null; then
  stamp "installing $PYTHON"
  dnf install -y -q "$PYTHON" "$PYTHON-pip"
fi
"$PYTHON" -c "$PY_CHECK" 2> /dev/null \
  || fail_final "no Python 3.11 or newer at $PYTHON: set BURSTCV_SIZING_PYTHON"
"""
_SIZING_WORK = r"""
STAGE=size
"$BURSTCV" measure --model "$MODEL_URI" --requests "$REQUESTS_URI" --out "$OUT_URI" \
  --slo-ms "$SLO_MS" --step-s "$STEP_S" --instance-type "${INSTANCE_TYPE:-$SIZED_TYPE}" \
  --instance-id "$INSTANCE_ID" --region "$AWS_REGION" --zone "$ZONE" &
SIZE_PID=$!
wait "$SIZE_PID"
SIZE_PID=""
stamp "sized $SIZED_TYPE"
"""


def render_sizing_user_data(spec: SizingBoxSpec) -> str:
    """Return the bash user-data of one sizing box: watchdog, identity, install, measure, off."""
    for name in ("model_uri", "requests_uri", "out_uri", "log_uri", "wheel_uri"):
        uri = getattr(spec, name)
        if not uri.startswith("s3://"):
            raise ValueError(f"a sizing box reads and writes S3; got {name} {uri!r}")
    config = {
        "SIZED_TYPE": spec.instance_type,
        "MODEL_URI": spec.model_uri,
        "REQUESTS_URI": spec.requests_uri,
        "OUT_URI": spec.out_uri,
        "LOG_URI": spec.log_uri,
        "SLO_MS": f"{spec.latency_slo_ms:g}",
        "STEP_S": f"{spec.step_s:g}",
    }
    parts = {
        "__FIRST_STAMP__": "sizing $SIZED_TYPE for run $RUN_ID",
        "__SETUP__": 'ZONE=$(imds meta-data/placement/availability-zone) || ZONE=""',
        "__ON_EXIT__": '  s3_object_exists "$OUT_URI" '
        '|| stamp "sizing ended in $STAGE (exit code $rc) with no figures"',
        "__RECORD_FAILURE__": "",
        "__PROBE_URI__": "$WHEEL_URI",  # an object that exists: the staged wheel
        "__SPOT_POLLER__": "",
        "__PYTHON_CHECK__": _SIZING_PYTHON,
        "__WHAT__": "sizing",
        "__ENTRY__": "burstcv-size",
        "__WORK__": _SIZING_WORK,
    }
    what = f"sizing box {_comment_safe(spec.instance_type)} for run {_comment_safe(spec.run_id)}"
    return _render(what, spec, config, parts)


_COMMENT = re.compile(r"\s*# (?!shellcheck)")


def parse_config(script: str) -> dict[str, str]:
    """Return the config block of a rendered script (what the instance will run)."""
    lines = (line.partition("=") for line in script.splitlines() if line.startswith("readonly "))
    return {key.removeprefix("readonly "): (shlex.split(raw) or [""])[0] for key, _, raw in lines}


def _comment_safe(text: str) -> str:
    return text.replace("\n", " ").replace("\r", " ")


# How the script stamps each step (``stamp``): "burstcv: <UTC time> <what>".
_STAMP = re.compile(r"burstcv: \d{4}-\d\d-\d\dT[\d:.]+Z (.+)")


def stamps(console: str) -> list[str]:
    """Return the steps a box's script stamped, in order, from its console output (where
    cloud-init copies the script's output: the one place a box without S3 can write)."""
    return [m.group(1).strip() for m in _STAMP.finditer(console)]
