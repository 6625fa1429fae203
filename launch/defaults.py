"""The defaults that the `a2` command's options show and the modules that apply them share, and the options that
`a2` and launch/commands/submit.py both take. Constants and argparse only, so that building a parser
(`launch/cli.py`) loads no module that does the work."""
from __future__ import annotations

import argparse

# where an S3 endpoint is set, first set first, when none is given (`launch.storage`; `launch.datacopies` reads a
# cluster file's setup commands the same way)
ENDPOINT_ENV_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL")

DEFAULT_STALE_AFTER = 120.0  # seconds without a heartbeat after which a study's lease is stale (`launch.lease`)

# `a2 package` (`launch.package`, `launch.commands.package`)
PACKAGE_OUT = "a2-packages"
SEEDS = (0, 1, 2, 3)  # the ensemble's seeds when the best configuration has fewer replicates with a checkpoint
SHARD_IMAGES = 500  # images per decoding shard: a killed package loses at most one shard per worker
SERVER_IMAGES = 81_279  # the COCO server's val2014 (40,504) + test2014 (40,775) images

# `a2 pipeline` (`launch.commands.pipeline`)
PIPELINE_STUDY = "studies/smoke.yaml"
PIPELINE_OUT = "a2-pipeline"

# `a2 study rehearse` and `a2 study plan --rehearse` (`launch.rehearse`)
REHEARSAL_STORAGE = "./a2-rehearsals"
LEARNING_DROP = 0.3  # the stand-in's learning curve: epoch e of E at 1 - drop (1 - e/E)^2 of the final mean


def add_lease_arguments(parser: argparse.ArgumentParser) -> None:
    """--force and --stale-after: taking over the lease of a study whose writer is gone (`launch.lease`)."""
    parser.add_argument("--force", action="store_true",
                        help="take over the study's lease if it is stale (its writer gone; never one whose process "
                             "is alive on this host)")
    parser.add_argument("--stale-after", type=float, default=DEFAULT_STALE_AFTER, metavar="SECONDS",
                        help=f"the period written in this process's lease: others take it as stale after this long "
                             f"without a heartbeat; another's lease is stale after its own period, or this one if "
                             f"longer (default {DEFAULT_STALE_AFTER:.0f})")
