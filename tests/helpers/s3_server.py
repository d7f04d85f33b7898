"""A real S3 server on 127.0.0.1 for the object-store tests: moto's threaded server (an HTTP S3 API
with multipart uploads and conditional puts), started once per test session, when a test first asks
for it (one endpoint per process: fsspec keeps one client per set of options, as in real use).

``s3_server`` (a pytest fixture) points the AWS environment (credentials, endpoint, region) at it,
so that fsspec/s3fs everywhere (our writer processes, Lightning's ``get_filesystem``) reach it
without options; ``s3_root`` is a fresh bucket per test, as an ``s3://`` URL.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading

import pytest

_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
_buckets = itertools.count()


class S3Server:
    def __init__(self, port: int = 0) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.port = port
        self._lock = threading.Lock()
        self.get_bytes = 0  # the bytes of every GET's response body so far (what readers downloaded)
        self.received_bytes = 0  # the bytes of every request's body so far (what writers uploaded)
        served = self.server._server.app  # moto keeps its werkzeug server private; the WSGI app on it is public
        self.server._server.app = lambda environ, start_response: self._counted(
            served(self._received(environ), start_response), environ["REQUEST_METHOD"] == "GET")

    def _received(self, environ: dict) -> dict:
        with self._lock:
            self.received_bytes += int(environ.get("CONTENT_LENGTH") or 0)
        return environ

    def _counted(self, body, counting: bool):
        for chunk in body:
            if counting:
                with self._lock:
                    self.get_bytes += len(chunk)
            yield chunk

    @classmethod
    def on_port(cls, port: int) -> "S3Server":
        """A server again where a stopped one was (moto keeps its buckets in this process)."""
        return cls(port)

    def env(self) -> dict[str, str]:
        return {**_ENV, "AWS_ENDPOINT_URL": self.endpoint}

    def new_bucket(self) -> str:
        import boto3

        name = f"ckpt-{os.getpid()}-{next(_buckets)}"
        boto3.client("s3", endpoint_url=self.endpoint, **_client_env()).create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.server.stop()


def _client_env() -> dict:
    return {"aws_access_key_id": _ENV["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": _ENV["AWS_SECRET_ACCESS_KEY"],
            "region_name": _ENV["AWS_DEFAULT_REGION"]}


@pytest.fixture(scope="session")
def s3_server():
    saved = {key: os.environ.get(key) for key in list(_ENV) + ["AWS_ENDPOINT_URL"]}
    server = S3Server()
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_root(s3_server) -> str:
    return f"s3://{s3_server.new_bucket()}"
