"""Run ``ec-s3 check`` against every S3 server of the test matrix and print each report.

Starts SeaweedFS, moto and Ceph RGW on loopback (the launchers the tests use:
``tests/support/s3_matrix.py``), makes a bucket on each, runs ``ec-s3 check`` (with any
extra arguments given, e.g. ``--json``) as an operator would, credentials from the
standard AWS environment variables, then stops them. A server that is not installed
is reported and skipped.

    PYTHONPATH=$PWD python scripts/check_matrix.py [--servers seaweedfs,moto,rgw] [-- CHECK ARGS]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import boto3  # noqa: E402

from support.s3_matrix import _LAUNCHERS, SERVERS  # noqa: E402


def check_one(name: str, check_args: list[str]) -> str:
    launcher = _LAUNCHERS[name]
    reason = launcher.unavailable_reason()
    if reason is not None:
        return f"skipped: {reason}\n"
    server = launcher()
    server.start()
    try:
        creds = server.credentials
        boto3.client("s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
                     aws_access_key_id=creds.access_key_id,
                     aws_secret_access_key=creds.secret_access_key).create_bucket(Bucket="ec-cache")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env |= {"AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key,
                "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "ec_s3.cli.main", "check", "--endpoint-url", server.endpoint_url,
               "--bucket", "ec-cache", "-q", *check_args]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
        shown = " ".join(["ec-s3", *cmd[3:]])
        return f"$ {shown}\n{done.stdout}{done.stderr}(exit status {done.returncode})\n"
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("check_args", nargs="*", help="passed to ec-s3 check (after --)")
    args = parser.parse_args()
    for name in args.servers.split(","):
        print(f"===== {name}")
        print(check_one(name, args.check_args), flush=True)


if __name__ == "__main__":
    main()
