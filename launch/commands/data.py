"""`a2 data synth|push|fetch`: the synthetic COCO written out, and a prepared feature store pushed to or fetched from
storage (`launch.datastore`)."""
from __future__ import annotations

import json

from a2core.data.synthetic import generate
from launch import datastore


def cmd_synth(args) -> int:
    """`a2 data synth --out DIR`: the synthetic COCO (`a2core.data.synthetic`)."""
    paths = generate(args.out, seed=args.seed, images=args.images, test_images=args.test_images,
                     test_split_images=args.test_split_images)
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
    return 0


def cmd_push(args) -> int:
    """`a2 data push STORE URI`."""
    manifest = datastore.push(args.store, args.uri, endpoint_url=args.endpoint_url)
    print(json.dumps({"uri": manifest["uri"], **{k: v for k, v in manifest.items() if k in ("checksum", "sha256")}},
                     indent=2))  # the URI written: a file pushed to a prefix ending in `/` takes its own name
    return 0


def cmd_fetch(args) -> int:
    """`a2 data fetch SOURCE TARGET`."""
    print(json.dumps(datastore.fetch(args.source, args.target, endpoint_url=args.endpoint_url), indent=2))
    return 0
