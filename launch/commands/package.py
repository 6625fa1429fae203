"""`a2 package NAME [--estimate]`: a study's best configuration -> its seed checkpoints -> averaging ensemble -> COCO
server `results.zip`, `leaderboard.json`, uploads and an MLflow model version (`launch.package`,
docs/how-to/package.md); with --estimate, what decoding will take, before anything runs."""
from __future__ import annotations

from a2core.decode import check_data_overrides
from launch.package import decode_estimate, estimate_text, package


def main(args) -> int:
    check_data_overrides(args.overrides)  # a key decoding would ignore, refused before any training or decoding
    options = {k: v for k, v in vars(args).items() if k not in ("command", "handler", "estimate", "overrides")}
    if getattr(args, "estimate", False):
        print(estimate_text(decode_estimate(args.name, storage=args.storage, seeds=args.seeds, beam_size=args.beam_size,
                                            batch_size=args.batch_size, workers=args.workers,
                                            val_images=args.val_images, shard_images=args.shard_images,
                                            test_images=args.test_images, data_overrides=args.overrides)))
        return 0
    package(**options, data_overrides=args.overrides)
    return 0
