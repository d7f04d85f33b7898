"""Fixtures shared by several test modules: the S3 server (started once per session, on first use)."""
from s3_server import s3_root, s3_server  # noqa: F401 - fixtures
