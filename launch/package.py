"""`a2 package`: best configuration of a study -> 4-seed ensemble -> COCO server zip, leaderboard, upload."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="study name")
    parser.add_argument("--storage", default=None, help="study storage root (local path or s3://...)")
    parser.add_argument("--alg", default=None, help="algorithm name used in the results file names")
    parser.add_argument("--no-train", action="store_true", help="refuse instead of training missing seeds")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--out", default=None, help="output directory")
    parser.add_argument("--upload", default=None, help="s3://bucket/prefix to upload results to")
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument("--beam-size", type=int, default=5)
    parser.add_argument("--workers", type=int, default=None, help="Ray decode workers; 0 decodes in this process")


def main(args) -> int:
    raise NotImplementedError("a2 package is not implemented yet")
