"""`a2 pipeline`: smoke study -> report -> packaging -> leaderboard, end to end."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--study", default="studies/smoke.yaml")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument("overrides", nargs="*", help="key=value study overrides")


def main(args) -> int:
    raise NotImplementedError("a2 pipeline is not implemented yet")
