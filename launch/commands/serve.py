"""`a2 mlflow serve`: the team's MLflow tracking server (`launch.mlflow_server`), from the command line's options."""
from __future__ import annotations

from launch.mlflow_server import serve


def cmd_serve(args) -> int:
    return serve(args.backend_store_uri, args.artifacts_destination, args.s3_endpoint_url, args.host, args.port,
                 args.workers)
