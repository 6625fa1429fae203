"""The placeholders of the shipped cluster and study files, refused wherever a URI is used (no imports: `a2 study
validate` loads this without pyarrow or boto3)."""
from __future__ import annotations

from a2core.errors import StorageError

# The bucket that ray-cluster.yaml's setup_commands and the COCO study files' `storage` name until a team puts its own.
PLACEHOLDER_BUCKET = "YOUR-BUCKET"


def refuse_placeholder(uri: str) -> None:
    """StorageError for a URI that still names the placeholder bucket, saying what to replace, before any request
    (or any node) is spent on it."""
    if uri == f"s3://{PLACEHOLDER_BUCKET}" or uri.startswith(f"s3://{PLACEHOLDER_BUCKET}/"):
        raise StorageError(f"{uri}: {PLACEHOLDER_BUCKET} is the placeholder of the shipped cluster and study files; "
                           f"replace it with your bucket")
