"""The defaults that the `a2` command's options show and the modules that apply them share. Constants only, importing
nothing, so that building the parser (`launch/cli.py`) loads no module that does the work."""

DEFAULT_STALE_AFTER = 120.0  # seconds without a heartbeat after which a study's lease is stale (`launch.lease`)

# `a2 package` (`launch.package`)
PACKAGE_OUT = "a2-packages"
SEEDS = (0, 1, 2, 3)  # the ensemble's seeds when the best configuration has fewer replicates with a checkpoint
SHARD_IMAGES = 500  # images per decoding shard: a killed package loses at most one shard per worker
SERVER_IMAGES = 81_279  # the COCO server's val2014 (40,504) + test2014 (40,775) images

# `a2 pipeline` (`launch.pipeline`)
PIPELINE_STUDY = "studies/smoke.yaml"
PIPELINE_OUT = "a2-pipeline"

# `a2 study rehearse` and `a2 study plan --rehearse` (`launch.rehearse`)
REHEARSAL_STORAGE = "./a2-rehearsals"
LEARNING_DROP = 0.3  # the stand-in's learning curve: epoch e of E at 1 - drop (1 - e/E)^2 of the final mean
