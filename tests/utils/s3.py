"""A real S3 API for the tests: moto's standalone server as a process (``moto_server``), and a
fresh bucket per test.

Fixtures (import them into a test module or a conftest): ``s3_server`` (one server per test
module) and ``s3_settings`` (a dict of ``Settings`` fields for a new bucket on it:
``storage_url``, ``s3_endpoint_url``, credentials, region)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.utils.processes import answers, free_port

ACCESS_KEY, SECRET_KEY, REGION = "testing", "testing", "us-east-1"


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def new_bucket(self) -> str:
        name = f"rh-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def settings(self, *, prefix: str = "roundhouse") -> dict[str, Any]:
        """``Settings`` fields for a new, empty bucket: ``Settings(home=..., **server.settings())``."""
        return {
            "storage_url": f"s3://{self.new_bucket()}/{prefix}",
            "s3_endpoint_url": self.endpoint_url,
            "s3_access_key_id": ACCESS_KEY,
            "s3_secret_access_key": SECRET_KEY,
            "s3_region": REGION,
        }


@contextlib.contextmanager
def moto_server(log: Path, *, timeout: float = 30.0) -> Iterator[S3Server]:
    """``moto_server`` on a free port of 127.0.0.1, stopped (and waited for) afterwards."""
    port = free_port()
    command = [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)]
    with log.open("ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not answers("127.0.0.1", port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield S3Server(f"http://127.0.0.1:{port}")
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto S3 server for the test module."""
    with moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


@pytest.fixture
def s3_settings(s3_server: S3Server) -> dict[str, Any]:
    """``Settings`` fields of a new bucket on the module's moto server."""
    return s3_server.settings()
