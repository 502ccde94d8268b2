"""The training wheel's ``burstcv`` console script (``preflight``, ``train``): argparse only."""

from __future__ import annotations

import argparse
import logging
import sys

from burstcv.training.job import STAGE_PREFLIGHT, load_job, write_failed

EXIT_PREFLIGHT_FAILED = 3


def preflight(job_uri: str, attempt: int, instance_type: str | None) -> int:
    """Check the box against the job; write a final FAILED (stage preflight) if it cannot train."""
    from burstcv.training.preflight import run_checks

    job = load_job(job_uri)
    findings = run_checks(job.require_cuda, instance_type or None)
    line = findings.summary()
    if findings.ok:
        logging.getLogger("burstcv.preflight").info("%s", line)
        return 0
    write_failed(job.output_uri, attempt, STAGE_PREFLIGHT, line, resumable=False)
    logging.getLogger("burstcv.preflight").error("preflight failed: %s", line)
    return EXIT_PREFLIGHT_FAILED


def train(job_uri: str, attempt: int) -> int:
    """Run the job; return its exit code (0 done, 143 interrupted, else failed)."""
    from burstcv.training.train import run_job

    return run_job(job_uri, attempt)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run one verb."""
    parser = argparse.ArgumentParser(prog="burstcv", description="burstcv training box")
    verbs = parser.add_subparsers(dest="verb", required=True)
    for name in ("train", "preflight"):
        verb = verbs.add_parser(name)
        verb.add_argument("--job", required=True, help="URI of job.json")
        verb.add_argument("--attempt", type=int, default=1, help="attempt number (from 1)")
        if name == "preflight":
            verb.add_argument("--instance-type", default="", help="for the GPU count check")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.verb == "preflight":
        return preflight(args.job, args.attempt, args.instance_type)
    return train(args.job, args.attempt)


if __name__ == "__main__":
    sys.exit(main())
