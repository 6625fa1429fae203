from tests.s3server import s3_endpoint  # noqa: F401
