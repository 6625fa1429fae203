"""`a2 package NAME`: a study's best configuration -> its seed checkpoints -> averaging ensemble -> COCO server
`results.zip`, `leaderboard.json`, uploads and an MLflow model version (docs/how-to/package.md).

`package` is a recipe of named steps: `ensemble_members` (missing seeds trained by `train_missing`),
`decoding_data`, `decode_all`, `write_submission`, `deliver`, `upload_all` and `write_manifest`.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import ray
import torch
from tqdm import tqdm

from a2core import checkpoint as ckpt
from a2core.atomic import atomic_write
from a2core.checksum import checksum_path, file_sha256
from a2core.data import prepared
from a2core.data.captions import Vocab, read_image_info
from a2core.decode import CAPTIONS_VERSION, checkpoint_data, ensemble_captions, write_results_json
from a2core.errors import A2Error, CheckpointError, PackageError, StorageError
from dashboards.runs import ReplicateGroup, Trial
from dashboards.stats import best_trial, config_hash, trial_rank
from dashboards.submission import make_zip, results_filename, validate_zip
from dashboards.tracking import check_tracking_uri
from launch.defaults import PACKAGE_OUT, SEEDS, SERVER_IMAGES, SHARD_IMAGES
from launch.conclusions import read_state_json
from launch.driver import resume_study, run_study, say
from launch.location import STUDY_FILE, StudyLocation, load_saved_spec, locate, refuse_rehearsal
from launch.record import StudyRecord, best_group
from launch.raycluster import connect, shutdown as stop_ray
from launch.spec import NAME_MAX, StudySpec
from launch.storage import (UploadConflict, check_storage, open_location, parse_s3_uri, same_bytes, stored_object,
                            upload_file)
from launch.tracking_writer import log_artifacts, study_parent_run
from launch.trainable import propagated_env
from launch.verify import model_mismatch

SEED_STUDIES_FILE = "seed_studies.json"
RESULTS_ZIP = "results.zip"
LEADERBOARD = "leaderboard.json"
MANIFEST = "package.json"
# Ray Train gives a worker group 60 s to start by default; on a busy small machine importing torch in two fresh
# workers can take longer. Applies to a Ray that this process starts (a cluster keeps its own setting).
WORKER_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
WORKER_START_TIMEOUT_S = "300"


def decode_estimate(name: str, *, storage: str | None = None, seeds=None, beam_size: int = 5, batch_size: int = 50,
                workers: int | None = None, val_images: str | None = None, test_images: str | None = None,
                data_overrides: list[str] | None = None, sample: int = 8, shard_images: int = SHARD_IMAGES) -> dict:
    """What decoding study `name`'s package costs: its images and shards (less those an earlier run kept), and
    the ensemble's seconds per image measured on `sample` Karpathy test images with copies of the best trial's
    checkpoint (an ensemble of M members costs M single-model passes per beam step)."""
    location, spec, record = open_study(name, storage, verbose=False)

    best, rows = best_and_candidates(spec, location, record)
    members = len(set(seeds)) if seeds else len(ensemble_seeds(rows, best.config_hash, exists_in(location))[0])
    checkpoint = fetch_checkpoint(best.best_checkpoint, checkpoint_cache(), location.endpoint_url)
    _, data_config, images = decoding_data(checkpoint, data_overrides, val_images, test_images)
    splits = images["splits"]
    unique = len(set().union(*map(set, splits.values())))
    shards = make_shards(splits, shard_images)
    ids = splits["test"][:sample + 2] or splits["val2014"][:sample + 2]
    options = dict(single_split=None, beam_size=beam_size, max_len=images["max_len"], batch_size=batch_size)
    ensemble_captions([checkpoint] * members, data_config, {"test": ids[:2]}, **options)  # warm-up (loading, caches)
    started = time.perf_counter()
    ensemble_captions([checkpoint] * members, data_config, {"test": ids[2:]}, **options)
    per_image = (time.perf_counter() - started) / max(1, len(ids) - 2)
    single_images = len(splits["test"]) if members > 1 else 0  # each member alone on the Karpathy test split
    cost = per_image * (unique + single_images)
    return {"study": name, "members": members, "beam_size": beam_size, "images": unique, "shards": len(shards),
            "shard_images": shard_images,
            "device": "cuda" if torch.cuda.is_available() else "cpu", "sample": len(ids) - 2,
            "seconds_per_image": per_image, "seconds": cost, "workers": workers,
            "server_seconds": per_image * SERVER_IMAGES}


def estimate_text(p: dict) -> str:
    hours = lambda s: f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min"  # noqa: E731
    w = p["workers"] or 1
    return (f"package decode plan for {p['study']}: {p['members']}-member ensemble, beam {p['beam_size']}\n"
            f"  images: {p['images']:,} distinct (val2014, test2014, Karpathy test) in {p['shards']} shards of "
            f"{p['shard_images']}\n"
            f"  measured here ({p['device']}, {p['sample']} images in one batch): {p['seconds_per_image']:.3f} s "
            f"per image for the ensemble\n"
            f"  decode: {hours(p['seconds'])} on one worker, {hours(p['seconds'] / w)} on {w} worker(s) of this "
            f"speed (plus each member alone on the Karpathy test split, included)\n"
            f"  the server's {SERVER_IMAGES:,} images (val2014 40,504 + test2014 40,775): "
            f"{hours(p['server_seconds'])} on one worker like this one; a shard kept by an earlier run is not "
            f"decoded again")


def package(name: str, *, storage: str | None = None, seeds=None, alg: str | None = None, no_train: bool = False,
            out: str | os.PathLike | None = None, upload: str | None = None, s3_endpoint_url: str | None = None,
            replace: bool = False,
            tracking_uri: str | None = None, beam_size: int = 5, batch_size: int = 50, workers: int | None = None,
            shard_images: int = SHARD_IMAGES,
            address: str | None = None, val_images: str | None = None, test_images: str | None = None,
            data_overrides: list[str] | None = None, model_name: str | None = None, verbose: bool = True) -> dict:
    """Package study `name` (see the module docstring). Returns the manifest (also written to package.json)."""
    t_start = time.perf_counter()
    for option, value in (("--beam-size", beam_size), ("--batch-size", batch_size), ("--shard-images", shard_images)):
        if value < 1:  # before a seed is trained or a shard decoded
            raise PackageError(f"{option}: must be >= 1, got {value}")
    location, spec, record = open_study(name, storage, verbose)
    seeds = None if seeds is None else list(dict.fromkeys(int(s) for s in seeds))
    if seeds is not None and not seeds:
        raise PackageError("--seeds: give at least one seed")
    alg = alg or name
    files = results_filename("val", alg), results_filename("test", alg)  # a bad --alg fails here, before any work
    tracking_uri = check_tracking_uri(tracking_uri or spec.tracking.mlflow_uri)
    check_upload(upload, s3_endpoint_url)
    upload_prefix = _upload_prefix(location, upload)
    upload_endpoint = s3_endpoint_url or (location.endpoint_url if not upload else None)
    check_replace(replace, upload_prefix)
    note_earlier_upload(upload_prefix, upload_endpoint, verbose, replace)
    out = package_folder(Path(out or Path(PACKAGE_OUT) / name).resolve(), name)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / ATTEMPT, json.dumps({"study": name}) + "\n")  # before any output: the folder is this run's
    ray_was_up = ray.is_initialized()
    os.environ.setdefault(WORKER_START_TIMEOUT_ENV, WORKER_START_TIMEOUT_S)
    try:
        best, members = ensemble_members(spec, location, record, seeds, no_train=no_train, address=address,
                                         verbose=verbose)
        local = [fetch_checkpoint(m.best_checkpoint, out / ".checkpoints", location.endpoint_url) for m in members]
        refuse_unreadable(members, local)
        data, data_config, images = decoding_data(local[0], data_overrides, val_images, test_images)
        # Ray workers fetch an s3:// checkpoint themselves; a local one by the absolute path fetched here
        sources = [m.best_checkpoint if m.best_checkpoint.startswith("s3://") else p for m, p in zip(members, local)]
        decoding = dict(beam_size=beam_size, max_len=images["max_len"], batch_size=batch_size)
        keep = location.at(DECODED_DIR, decode_key(local, images["splits"], "test", data_config, **decoding,
                                                   shard_images=shard_images))
        decoded = decode_all(sources, data_config, images["splits"], "test", **decoding, workers=workers,
                             address=address, endpoint_url=location.endpoint_url, verbose=verbose, keep=keep,
                             shard_images=shard_images)
        clear_attempt(out, verbose)  # once this run has captions of its own: a refused run leaves the folder be
        results = write_submission(out, files, decoded, images, alg, verbose)
        delivered = deliver(name, spec, best, members, local, data, decoded, results, images,
                            tracking_uri=tracking_uri, beam_size=beam_size, model_name=model_name or name,
                            verbose=verbose)
        uploads = upload_all([results["zip"], delivered["leaderboard"]], upload_prefix, upload_endpoint, verbose,
                             replace)
    finally:
        if not ray_was_up and ray.is_initialized():
            stop_ray()  # a local Ray it started stops at once (`launch.raycluster.shutdown`)
    manifest = write_manifest(out, location, best, members, results, delivered, uploads, decoded["seconds"],
                              time.perf_counter() - t_start)
    say(f"package: done in {manifest['seconds']:.0f} s\n  submission:  {results['zip']}\n  leaderboard: "
        f"{delivered['leaderboard']}\n  MLflow:      {delivered['mlflow']['model_uri']} (run "
        f"{delivered['mlflow']['parent_run_id']}, artifacts {delivered['mlflow']['artifacts']})"
        + "".join(f"\n  {'uploaded:' if u['uploaded'] else 'was there:':<13}{u['uri']}" for u in uploads), verbose)
    return manifest


KARPATHY_CAPTIONS = "captions_karpathy_test_ensemble.json"
# Written into a package folder before anything else: its outputs without a manifest are then a stopped run of this
# study's package, which a rerun may clear (`clear_attempt`); the same names in a folder without it are someone's own.
ATTEMPT = ".a2-package-attempt"


def _outputs(out: Path) -> list[Path]:
    """The files of `out` that a package run writes (and `clear_attempt` removes)."""
    names = [RESULTS_ZIP, LEADERBOARD, KARPATHY_CAPTIONS, f".{RESULTS_ZIP}.staging"]
    return [p for p in sorted(out.glob("captions_*2014_*_results.json")) + [out / n for n in names] if p.is_file()]


def _attempt_of(out: Path) -> str | None:
    """The study whose package run claimed `out` (its ATTEMPT file), None when none did or the file does not read."""
    try:
        claimed = json.loads((out / ATTEMPT).read_text())
    except (OSError, ValueError):
        return None
    return claimed.get("study") if isinstance(claimed, dict) else None


def package_folder(path: Path, name: str) -> Path:
    """`path`, else the first of `path-2`, `path-3`, ... that holds no finished package (its manifest, written last)
    and no package outputs other than those of a stopped run of study `name`'s package (a hand-made results.zip,
    another study's attempt): only a run's own folder is continued and cleared, nothing else in it is lost."""
    candidate, n = path, 1
    while (candidate / MANIFEST).exists() or (_outputs(candidate) and _attempt_of(candidate) != name):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    if candidate != path:
        what = ("an earlier package" if (path / MANIFEST).exists() else
                f"submission files that no stopped run of {name}'s package left")
        print(f"{path} holds {what}; this run writes to {candidate}", flush=True)
    return candidate


def clear_attempt(out: Path, verbose: bool = True) -> None:
    """Remove what an earlier, unfinished run left in `out` (no manifest: it stopped before the end), called once
    this run has decoded its own captions: the old zip, leaderboard and results files describe other captions, and
    a run that fails from here must not leave them beside its own as if they were its output. Only these names are
    touched; the checkpoint cache stays. `package_folder` hands a folder with such files only to the run of the
    study that left them."""
    stale = _outputs(out)
    for path in stale:
        path.unlink()
    if stale:
        say(f"package: {out} held an unfinished run's {', '.join(p.name for p in stale)}: removed", verbose)


# -- 1. the ensemble's members -----------------------------------------------------------------------------------
def open_study(name: str, storage: str | None, verbose: bool = True) -> tuple[StudyLocation, StudySpec, StudyRecord]:
    """(location, saved spec, record) of a study that has trials and no live writer: its record read from its
    storage (`launch.record.StudyRecord.load`, the one reader of a study's state; not its summary.json, a cache of it),
    a damaged result log or Tune state refused naming the file."""
    location = locate(name, storage)
    spec = load_saved_spec(location)
    refuse_rehearsal(location)
    record = StudyRecord.load(location, spec, refuse="package")  # its checkpoints where the study is now
    if record.running:  # its best configuration is not settled, and a second writer would share its storage
        raise PackageError(f"study {name!r} at {location.uri()} is still running: package it once it ends "
                           f"(`a2 study status {name}`)")
    if not record.trials:
        raise PackageError(f"study {name!r} at {location.uri()} has no trials yet: finish it first "
                           f"(`a2 study resume {name}`)")
    done = sum(1 for t in record.trials if t.state == "TERMINATED")
    if not (done == spec.num_trials and len(record.trials) == spec.num_trials):  # the summary's `complete`
        say(f"package: note: study {name} is not complete ({done}/{spec.num_trials} trials finished); "
            f"packaging what it has", verbose)
    return location, spec, record


def candidates(spec, trials: list[Trial], digest: str | None = None) -> list[Trial]:
    """The record's trials (`StudyRecord.trials`) that reported the metric and have a best checkpoint and a config
    the study's saved spec resolves (only those of configuration `digest` when given)."""
    out = []
    for trial in trials:
        if trial.best_value is None or not trial.best_checkpoint:
            continue
        if not trial.config:  # the record's config of a trial the saved spec cannot rebuild any more
            try:
                spec.trial_config(dict(trial.sampled))
            except A2Error as err:
                print(f"a2 package: note: skipping trial {trial.trial_id} of {spec.name}: {err}", file=sys.stderr)
        elif digest is None or trial.config_hash == digest:
            out.append(trial)
    return out


def select_best(group: ReplicateGroup | None, cands: list[Trial], mode: str, study: str) -> Trial:
    """The candidate of the best trial of the study's best configuration `group` (`launch.record.best_group`, the
    one rule every view reads: `status`, `compare`, `report`); when that trial has no stored checkpoint, the best of
    its configuration's trials that has one (`dashboards.stats.best_trial`, the record's own rule)."""
    pool = [c for c in cands if group is not None and c.config_hash == group.config_hash]
    if not pool:
        raise PackageError(
            "no trial of the study reported its metric with a checkpoint: nothing to package" if group is None else
            f"study {study}: no trial of the best configuration (config {str(group.config_hash)[:12]}, trials "
            f"{', '.join(map(str, group.trials))}) has a stored checkpoint: nothing to package")
    named = next((c for c in pool if c.trial_id == str(group.best_trial)), None)
    return named or best_trial(pool, mode)


def seed_checkpoints(cands: list[Trial], digest: str, seeds, mode: str,
                     exists: Callable[[str], bool]) -> tuple[dict[int, Trial], list[int]]:
    """For each seed, the trial of configuration `digest` with that seed whose checkpoint exists (finished
    trials first, then `dashboards.stats.trial_rank`: the best by the metric, then the lower (study, trial id)); and
    the seeds that have none."""
    rank, chosen = trial_rank(mode), {}
    for seed in seeds:
        pool = sorted((c for c in cands if c.config_hash == digest and c.seed == seed),
                      key=lambda c: (c.state not in (None, "TERMINATED"), *rank(c)))
        if (hit := next((c for c in pool if exists(c.best_checkpoint)), None)) is not None:
            chosen[seed] = hit
    return chosen, [seed for seed in seeds if seed not in chosen]


def ensemble_seeds(cands: list[Trial], digest: str, exists: Callable[[str], bool]) -> tuple[list[int], str]:
    """The seeds of the ensemble when none are given, and why: configuration `digest`'s replicates with a
    checkpoint when there are at least len(SEEDS) of them (nothing is trained), else SEEDS."""
    own = sorted({c.seed for c in cands if c.config_hash == digest and exists(c.best_checkpoint)})
    if len(own) >= len(SEEDS):
        return own, f"the best configuration's {len(own)} replicates"
    return list(SEEDS), f"the best configuration has {len(own)} replicate(s) with a checkpoint, fewer than {len(SEEDS)}"


def exists_in(location) -> Callable[[str], bool]:
    """Whether a checkpoint's URI exists, in the study's storage (its endpoint)."""
    return lambda uri: open_location(uri, location.endpoint_url).exists()


def best_and_candidates(spec, location, record: StudyRecord) -> tuple[Trial, list[Trial]]:
    """The study's best trial and the trials its ensemble may take checkpoints from: the record's (`candidates`)
    and those of the best configuration in its companion seed studies (packaging's earlier runs)."""
    rows = candidates(spec, record.trials)
    best = select_best(best_group(spec, record.groups()), rows, spec.mode, spec.name)
    for _, comp_spec, comp_record in _companions(location, best.config_hash):
        rows += candidates(comp_spec, comp_record.trials, best.config_hash)
    return best, rows


def ensemble_members(spec, location, record: StudyRecord, seeds: list[int] | None, *, no_train: bool,
                     address: str | None, verbose: bool) -> tuple[Trial, list[Trial]]:
    """The study's best trial and, per seed, the trial of its configuration whose checkpoint joins the ensemble
    (missing seeds trained as a companion study unless `no_train`). `seeds` None: `ensemble_seeds`."""
    exists = exists_in(location)
    best, rows = best_and_candidates(spec, location, record)
    digest = best.config_hash
    say(f"package: best trial {best.trial_id} of {spec.name}: {spec.metric} {best.best_value:.2f} "
        f"(fusion {best.fusion}, seed {best.seed}, config {digest[:12]})", verbose)
    if seeds is None:
        seeds, why = ensemble_seeds(rows, digest, exists)
        say(f"package: ensemble seeds {', '.join(map(str, seeds))} ({why})", verbose)
    chosen, missing = seed_checkpoints(rows, digest, seeds, spec.mode, exists)
    if missing and no_train:
        have = ", ".join(f"seed {s}: trial {c.trial_id}" for s, c in sorted(chosen.items())) or "none"
        raise PackageError(
            f"study {spec.name}: no checkpoint of the best configuration (trial {best.trial_id}, config "
            f"{digest[:12]}) for seed(s) {', '.join(map(str, missing))} (found {have}); run without "
            f"--no-train to train them, or pass --seeds with the seeds that exist")
    if missing:
        rows += train_missing(spec, location, best, missing, address=address, verbose=verbose)
        chosen, missing = seed_checkpoints(rows, digest, seeds, spec.mode, exists)
        if missing:
            raise PackageError(f"training seed(s) {', '.join(map(str, missing))} produced no checkpoint; see "
                               + ", ".join(f"`a2 study status {c}`" for c in companion_studies(location)))
    members = [chosen[s] for s in seeds]
    for m in members:
        say(f"package: seed {m.seed}: trial {m.trial_id} of {m.study} ({spec.metric} {m.best_value:.2f}), "
            f"{m.best_checkpoint}", verbose)
    return best, members


def refuse_unreadable(members: list[Trial], local: list[str]) -> None:
    """PackageError (exit 2) naming the stored checkpoint of a member that does not load, before any decoding."""
    for member, path in zip(members, local):
        which = f"{member.best_checkpoint} (trial {member.trial_id}, seed {member.seed})"
        try:
            state = ckpt.load(path)
        except CheckpointError as err:
            raise PackageError(f"{which}: {str(err).replace(f'{path}: ', '')}; nothing was decoded: restore the file "
                               f"from a copy (`a2 study check NAME` verifies every checkpoint)") from None
        # a file of another model swapped in: one line here, not a size-mismatch traceback when it is built
        mismatch = model_mismatch(state, member.config.get("model"))
        if mismatch is not None:
            raise PackageError(f"{which}: {mismatch}; nothing was decoded: restore the trial's own checkpoint (`a2 "
                               f"study check NAME` verifies every checkpoint)")


def fetch_checkpoint(uri: str, cache_dir: str | os.PathLike, endpoint_url: str | None = None) -> str:
    """A local path of a checkpoint: local paths as they are, s3:// objects downloaded (verified) once per content."""
    location = open_location(uri, endpoint_url)
    if location.local:
        return location.uri
    recorded = location.recorded_checksum()  # its sha256, written beside it
    size, stored_sha256 = location.stored_digest()
    # Cached by what is stored now, not by the URI alone: a checkpoint trained again under the same name (a study
    # started again in place, an epoch retrained) is downloaded again, never an older download taken for it.
    key = hashlib.sha256(f"{uri}\n{size}\n{stored_sha256}\n{recorded}".encode()).hexdigest()[:16]
    target = Path(cache_dir) / key / "checkpoint.pt"
    if not target.is_file():
        if recorded is not None:  # beside the copy, before it: `a2core.checkpoint.load` checks the copy against it
            atomic_write(checksum_path(target), recorded)
        location.download(target)
    return str(target)


# -- 1b. training the missing seeds ------------------------------------------------------------------------------
def seeds_spec(spec, location, config: dict, seeds: list[int], name: str):
    """A study that trains `config` with each of `seeds`, with the parent study's resources and places: the seeds
    fused in one trial when the parent's are (`resources.fuse_replicates`) and there are two or more, else a seed
    grid, a trial each."""
    resources = spec.resources.model_dump(exclude_none=True)
    resources["fuse_replicates"] = fused = bool(resources.get("fuse_replicates")) and len(seeds) > 1
    resources["capture_step"] = fused and bool(resources.get("capture_step"))  # a fused step's, or none
    seeding = ({"replicates": [int(s) for s in seeds], "space": {}} if fused
               else {"space": {"seed": {"grid": [int(s) for s in seeds]}}})
    raw = {"name": name, "data": config["data"], "model": config["model"],
           "train": {k: v for k, v in config["train"].items() if k != "seed"},
           "search": {"metric": spec.metric, "mode": spec.mode, "algorithm": "grid", **seeding,
                      "scheduler": {"fifo": {}}},
           "resources": resources, "tracking": {"mlflow_uri": spec.tracking.mlflow_uri},
           "storage": location.storage, "storage_endpoint_url": location.endpoint_url}
    return StudySpec.from_dict(raw, source=f"seeds of {spec.name} ({location.uri()})")


def seed_study_name(study: str, digest: str, index: int) -> str:
    suffix = f"-seeds-{digest[:8]}-{index}"
    return f"{study[:NAME_MAX - len(suffix)].rstrip('-')}{suffix}"


def companion_studies(location) -> list[str]:
    """The seed studies packaging trained for this study (seed_studies.json)."""
    listed = read_state_json(location.at(SEED_STUDIES_FILE), "the list of packaging's seed studies",
                             "restore it from a copy, or remove it (the seed studies are trained again)") or {}
    return list(listed.get("studies", []) if isinstance(listed, dict) else [])


def _companions(location, digest: str) -> list[tuple[StudyLocation, StudySpec, StudyRecord]]:
    """(location, spec, record) of each companion seed study of configuration `digest`."""
    found = []
    for name in companion_studies(location):
        comp = StudyLocation(name, location.storage, location.endpoint_url)
        if comp.exists(STUDY_FILE):
            comp_spec = load_saved_spec(comp)
            if config_hash(comp_spec.trial_config({"seed": 0})) == digest:
                found.append((comp, comp_spec, StudyRecord.load(comp, comp_spec, refuse="package")))
    return found


def train_missing(spec, location, best: Trial, missing: list[int], *, address: str | None,
                  verbose: bool) -> list[Trial]:
    """Train the missing seeds of the best configuration as a companion study (an unfinished earlier one is resumed
    first); returns the candidates it gave."""
    digest = best.config_hash
    rows, covered = [], set()
    for comp, comp_spec, comp_record in _companions(location, digest):
        # finished: every planned trial is in its record and ended TERMINATED (finished, or stopped early by the
        # scheduler), and one reported the metric
        trials = comp_record.trials
        if not (len(trials) == comp_spec.num_trials and all(t.state == "TERMINATED" for t in trials)
                and any(t.best_value is not None for t in trials)):
            say(f"package: resuming the unfinished seed study {comp.name}", verbose)
            covered.update(comp_spec.seed_values)  # a seed grid, or fused seeds (search.replicates)
            resume_study(comp, address=address, verbose=verbose)
            rows += candidates(comp_spec, StudyRecord.load(comp, comp_spec, refuse="package").trials, digest)
    # Seeds of a resumed study are not trained again elsewhere: if it still lacks them, packaging says so.
    todo = [s for s in missing if s not in covered]
    if not todo:
        return rows
    names = companion_studies(location)
    index = 0
    while (name := seed_study_name(spec.name, digest, index)) in names or StudyLocation(
            name, location.storage, location.endpoint_url).exists(STUDY_FILE):
        index += 1
    new_spec = seeds_spec(spec, location, best.config, todo, name)
    # Listed before it runs, so that an interrupted run is found (and resumed) by the next package run.
    location.write_text(json.dumps({"studies": names + [name]}, indent=2) + "\n", SEED_STUDIES_FILE)
    say(f"package: training seed(s) {', '.join(map(str, todo))} of trial {best.trial_id}'s configuration "
        f"as study {name}", verbose)
    run_study(new_spec, address=address, verbose=verbose)
    made = StudyRecord.load(StudyLocation(name, location.storage, location.endpoint_url), new_spec, refuse="package")
    return rows + candidates(new_spec, made.trials, digest)


# -- 2. decoding -------------------------------------------------------------------------------------------------
def decoding_data(checkpoint: str, data_overrides: list[str] | None, val_images: str | None,
                  test_images: str | None):
    """(CaptionData, its data config, {"splits": {split: image ids}, "sources", "max_len"}) for decoding the
    server's val2014 / test2014 images and the Karpathy test split with the checkpoints' vocabulary."""
    state = ckpt.load(checkpoint)
    data = checkpoint_data(state["config"], Vocab(state["vocab"]), data_overrides)
    test_file = test_images or data.paths.test_images
    if not test_file:
        raise PackageError("no test2014 image list: set data.test_images in the study or pass --test-images")
    if val_images:
        val_ids, val_source = read_image_info(val_images), str(val_images)
    else:  # the data's image-info file, else the captions' images with filepath val2014
        val_ids = list(dict.fromkeys(img.image_id for img in data.images("val2014")))
        has_file = data.paths.val_images and Path(data.paths.val_images).is_file()
        val_source = str(data.paths.val_images) if has_file else f"{data.paths.captions} (filepath val2014)"
    test_ids = read_image_info(test_file)
    # a list of no images gives a results file of no captions, which covers it and validates: the server refuses it
    for split, ids, source in (("val2014", val_ids, val_source), ("test2014", test_ids, test_file)):
        if not ids:
            raise PackageError(f"the {split} image list ({source}) holds no image: give the server's list of {split} "
                               f"(--{split[:-4]}-images)")
    if both := sorted(set(val_ids) & set(test_ids)):  # COCO's val2014 and test2014 share no image
        raise PackageError(f"{len(both)} image id(s) are in both the val2014 list ({val_source}) and the test2014 "
                           f"list ({test_file}), e.g. {both[:5]}: the two server sets are disjoint; is one file "
                           f"given for the other?")
    karpathy = [img.image_id for img in data.images("test")]
    data.features.check_ids(list(dict.fromkeys(val_ids + test_ids + karpathy)))
    return data, data.cfg.model_dump(by_alias=True), {
        "splits": {"val2014": val_ids, "test2014": test_ids, "test": karpathy},
        "sources": {"val2014": val_source, "test2014": str(test_file)},
        "max_len": int(state["config"]["train"].get("max_len", 20))}


def checkpoint_cache() -> Path:
    """This machine's copies of s3:// checkpoints, one folder per user: the temp folder is shared by every account of
    a machine (a cluster node runs Ray as one, a laptop's tests as another), and a folder another account made first
    is not writable."""
    return Path(tempfile.gettempdir()) / f"a2-package-checkpoints-{os.getuid()}"


def decode_shard(checkpoints: list[str], data_config: dict, shard: dict[str, list[int]], single_split: str | None,
                 endpoint_url: str | None = None, **options) -> dict:
    """`a2core.decode.ensemble_captions` of local or s3:// checkpoints (fetched once per machine), in a Ray task or
    in this process."""
    local = [fetch_checkpoint(c, checkpoint_cache(), endpoint_url) for c in checkpoints]
    return ensemble_captions(local, data_config, shard, single_split, **options)


DECODED_DIR = "package-decoded"  # in the study's storage: one folder of finished shards per decoding job


def decode_key(checkpoints: list[str], splits: dict[str, list[int]], single_split: str | None,
               data_config: dict | None = None, **options) -> str:
    """What a decoding job's shards depend on: the checkpoints' bytes, the image lists, the decoding options and the
    data the regions come from (`data_config` and its files as they are now: another feature store, or the same
    path rewritten, decodes anew rather than mixing its captions with kept ones)."""
    files = [file_sha256(path) for path in checkpoints]
    data = [data_config, _file_stamps(data_config or {})]
    # the decoder's own version too: captions an earlier decoder kept (e.g. holding <unk>) are not reused
    return hashlib.sha256(json.dumps([files, splits, single_split, sorted(options.items()), *data, CAPTIONS_VERSION],
                                     sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_stamps(data_config: dict) -> dict:
    """{key: (size, modification time)} of the data config's feature and caption paths on this machine; a prepared
    store's manifest checksum (its identity, whatever its folder's times)."""
    stamps = {}
    for key in ("features", "captions", "root"):
        path = data_config.get(key)
        if not isinstance(path, str) or "://" in path or not os.path.exists(path):
            continue
        manifest = Path(path) / prepared.MANIFEST
        if manifest.is_file():
            stamps[key] = hashlib.sha256(manifest.read_bytes()).hexdigest()
        else:
            stat = os.stat(path)
            stamps[key] = (stat.st_size, stat.st_mtime_ns)
    return stamps


def make_shards(splits: dict[str, list[int]], size: int = SHARD_IMAGES) -> list[dict[str, list[int]]]:
    """Consecutive runs of `size` distinct images (an image in several splits is in one shard), as
    {split: the run's images of that split}; the same lists give the same shards."""
    unique = list(dict.fromkeys(i for ids in splits.values() for i in ids))
    shards = []
    for start in range(0, len(unique), size):
        run = set(unique[start:start + size])
        shards.append({split: [i for i in ids if i in run] for split, ids in splits.items()})
    return shards


def _kept_shard(text: str, shard: dict[str, list[int]], members: int, single_split: str | None) -> dict | None:
    """A kept shard's captions (image ids as ints), None when the file does not parse or lacks a caption of one of
    its images (a shard is written whole, but a copy can be cut short or edited)."""
    try:
        part = _shard_ids(json.loads(text), int)
    except (ValueError, TypeError, AttributeError, KeyError, RecursionError):
        return None
    ensemble, single = part["ensemble"], part["single"]
    if any(not isinstance(ensemble.get(split), dict) or any(not isinstance(ensemble[split].get(i), str) for i in ids)
           for split, ids in shard.items()):
        return None
    solo = shard.get(single_split, []) if single_split is not None and members > 1 else []
    if solo and (len(single) != members or any(not isinstance(s.get(i), str) for s in single for i in solo)):
        return None
    return part


def _shard_ids(part: dict, key: Callable) -> dict:
    """A decoded shard with its image ids as `key` makes them (str for its JSON file, int read back from it)."""
    return {"ensemble": {split: {key(i): c for i, c in caps.items()} for split, caps in part["ensemble"].items()},
            "single": [{key(i): c for i, c in caps.items()} for caps in part["single"]]}


def decode_all(checkpoints: list[str], data_config: dict, splits: dict[str, list[int]], single_split: str | None,
               *, beam_size: int, max_len: int, batch_size: int, workers: int | None, address: str | None,
               endpoint_url: str | None, verbose: bool = True, keep=None, shard_images: int = SHARD_IMAGES) -> dict:
    """The ensemble's captions of every split and each checkpoint's on `single_split`, decoded in shards of
    `shard_images` images on Ray tasks or, with workers=0, in this process. Returns {"ensemble", "single",
    "seconds", "shards", "reused"}.

    `keep` (a storage `Location`, the study's `package-decoded/<key>` folder) receives every finished shard; a shard
    already there is read back instead of decoded, so a killed `a2 package` continues where it stopped and gives
    the same captions (each shard's images are decoded in the same batches either way)."""
    t0 = time.perf_counter()
    options = dict(single_split=single_split, beam_size=beam_size, max_len=max_len, batch_size=batch_size,
                   endpoint_url=endpoint_url)
    shards = make_shards(splits, shard_images)
    parts: dict[int, dict] = {}
    shard_file = "shard-{:05d}.json".format
    if keep is not None:
        names = set(keep.listdir())
        for index in range(len(shards)):
            if shard_file(index) in names and (text := keep.join(shard_file(index)).read_text()) is not None:
                part = _kept_shard(text, shards[index], len(checkpoints), single_split)
                if part is None:  # decoded again below, and written over
                    say(f"package: note: {keep.join(shard_file(index)).uri} is damaged or does not cover its "
                        f"images; decoding that shard again", verbose)
                else:
                    parts[index] = part
    todo = [i for i in range(len(shards)) if i not in parts]
    images = lambda index: len(set().union(*shards[index].values()))  # noqa: E731
    what = (f"{sum(images(i) for i in todo)} images in {len(todo)} shard(s) with {len(checkpoints)} checkpoint(s)"
            + (f"; {len(parts)} of {len(shards)} shards were decoded before (kept in {keep})" if parts else ""))
    if todo:
        # images, not shards: the bar's rate and time left are those of the decoding
        with tqdm(total=sum(images(i) for i in todo), desc="decode", unit="img", file=sys.stderr,
                  disable=not verbose, smoothing=0.1) as bar:
            def finished(index: int, part: dict) -> None:
                if keep is not None:
                    keep.join(shard_file(index)).write_text(json.dumps(_shard_ids(part, str)))
                parts[index] = part
                bar.update(images(index))

            if workers == 0:
                say(f"package: decoding {what} in this process", verbose)
                for index in todo:
                    finished(index, decode_shard(checkpoints, data_config, shards[index], **options))
            else:
                _decode_on_ray(checkpoints, data_config, [(i, shards[i]) for i in todo], options, workers, address,
                               what, verbose, finished)
    merged: dict[str, Any] = {"ensemble": {split: {} for split in splits}, "single": [{} for _ in checkpoints]}
    for _, part in sorted(parts.items()):
        for split, captions in part["ensemble"].items():
            merged["ensemble"][split].update(captions)
        for single, captions in zip(merged["single"], part["single"]):
            single.update(captions)
    for split, ids in splits.items():
        if lost := [i for i in ids if i not in merged["ensemble"][split]]:
            raise PackageError(f"decoding lost {len(lost)} {split} images (e.g. {lost[:5]})")
    merged["seconds"] = time.perf_counter() - t0
    merged["shards"], merged["reused"] = len(shards), len(shards) - len(todo)
    say(f"package: decoded in {merged['seconds']:.1f} s", verbose)
    return merged


def _decode_on_ray(checkpoints: list[str], data_config: dict, shards: list[tuple[int, dict]], options: dict,
                   workers: int | None, address: str | None, what: str, verbose: bool,
                   finished: Callable[[int, dict], Any]) -> None:
    """`decode_shard` of each (index, shard) as Ray tasks, one GPU each if there are, at most `workers` at a time
    (default: one per GPU, else per CPU, at most 8); `finished(index, part)` as each one ends."""
    resources = connect(address, runtime_env_vars=propagated_env())
    gpus = int(resources.get("GPU", 0) or 0)
    n = workers or gpus or max(1, min(8, int(resources.get("CPU", 1) or 1)))
    task = ray.remote(decode_shard).options(num_cpus=1, num_gpus=1 if gpus else 0, max_retries=2)
    say(f"package: decoding {what} on {n} Ray worker(s){' (1 GPU each)' if gpus else ''}", verbose)
    queue, running = list(shards), {}
    while queue or running:
        while queue and len(running) < n:  # at most n at a time: a finished shard is kept before the next starts
            index, shard = queue.pop(0)
            running[task.remote(checkpoints, data_config, shard, **options)] = index
        ready, _ = ray.wait(list(running), num_returns=1)
        for ref in ready:
            finished(running.pop(ref), ray.get(ref))


# -- 3-5. the submission, its delivery and uploads ------------------------------------------------------------------
def write_submission(out: Path, files: tuple[str, str], decoded: dict, images: dict, alg: str,
                     verbose: bool = True) -> dict:
    """The two results files, `results.zip` (validated before it is renamed into place: an invalid submission
    leaves no zip) and the ensemble's Karpathy-test captions. Returns {"zip", "files", "alg"}."""
    val_ids, test_ids = images["splits"]["val2014"], images["splits"]["test2014"]
    paths = [out / f for f in files]
    for path, split, ids in zip(paths, ("val2014", "test2014"), (val_ids, test_ids)):
        write_results_json(path, {i: decoded["ensemble"][split][i] for i in ids})
    staging = out / f".{RESULTS_ZIP}.staging"
    make_zip(staging, *paths)
    report = validate_zip(staging, val_ids, test_ids, alg=alg)
    if not report.ok:
        staging.unlink(missing_ok=True)
        raise PackageError(f"the submission failed validation, no {RESULTS_ZIP} written:\n{report}")
    os.replace(staging, out / RESULTS_ZIP)
    say(f"package: {out / RESULTS_ZIP}: valid ({len(val_ids)} val2014 + {len(test_ids)} test2014 captions)", verbose)
    write_results_json(out / KARPATHY_CAPTIONS, decoded["ensemble"]["test"])
    return {"zip": out / RESULTS_ZIP, "files": paths, "alg": alg}


def member_entry(member: Trial) -> dict:
    """A member of the ensemble as the manifest and the leaderboard name it."""
    return {"seed": member.seed, "study": member.study, "trial_id": member.trial_id,
            "checkpoint": member.best_checkpoint, "value": member.best_value}


def deliver(name: str, spec, best: Trial, members: list[Trial], local: list[str], data, decoded: dict, results: dict,
            images: dict, *, tracking_uri: str, beam_size: int, model_name: str, verbose: bool = True) -> dict:
    """Karpathy-test scores of every seed and the ensemble, the ensemble registered as an MLflow model, and the
    leaderboard (which names that model version) written and logged with the zip to the study's parent run.
    Returns {"scores", "board", "leaderboard" (its path), "mlflow"}."""
    # MLflow and the leaderboard: not in the Ray tasks that run `decode_shard`, which import this module
    from dashboards import leaderboard as lb
    from launch.model_registry import register_ensemble

    karpathy = images["splits"]["test"]
    say(f"package: scoring {len(members)} checkpoint(s) and the ensemble on the Karpathy test split "
        f"({len(karpathy)} images)", verbose)
    systems = {f"seed-{m.seed}": decoded["single"][i] for i, m in enumerate(members)}
    scores, per_image = lb.score_systems(data.references("test"), {**systems, "ensemble": decoded["ensemble"]["test"]})
    run_ids = {study: lb.trial_run_ids(tracking_uri, study) for study in sorted({m.study for m in members})}
    parent = study_parent_run(tracking_uri, name)
    model = register_ensemble(
        tracking_uri, parent, local, model_name, beam_size=beam_size, max_len=images["max_len"],
        description=f"{len(members)}-seed averaging ensemble of study {name} (config {best.config_hash[:12]})",
        tags={"a2.study": name, "a2.config_hash": best.config_hash, "a2.seeds": ",".join(str(m.seed) for m in members),
              "a2.trial_ids": ",".join(m.trial_id for m in members)})
    say(f"package: MLflow model {model['name']} version {model['version']}: " + (
        "reused (it already serves these checkpoints)" if model["reused"] else "registered"), verbose)
    board = lb.build_leaderboard(
        study=name, config=best.config, ensemble_metrics=scores["ensemble"], images=len(karpathy),
        members=[{**member_entry(m), "metrics": scores[f"seed-{m.seed}"],
                  "mlflow_run_id": run_ids[m.study].get(m.trial_id)} for m in members],
        beam_size=beam_size, max_len=images["max_len"], per_image=per_image,
        selected_by={"metric": spec.metric, "mode": spec.mode, "trial_id": best.trial_id, "value": best.best_value,
                     "tie_break": "lower trial id"},
        extra={"submission": {"zip": str(results["zip"]), "alg": results["alg"],
                              "files": [p.name for p in results["files"]],
                              "val2014_images": len(images["splits"]["val2014"]),
                              "test2014_images": len(images["splits"]["test2014"]), "image_lists": images["sources"]},
               "mlflow": {"tracking_uri": tracking_uri, "parent_run_id": parent, "registered_model": model["name"],
                          "model_version": model["version"], "model_uri": model["model_uri"],
                          "study_run_ids": run_ids}})
    board_path = lb.write_leaderboard(results["zip"].parent / LEADERBOARD, board)
    print(lb.format_table(board), flush=True)
    artifacts = log_artifacts(tracking_uri, parent, [results["zip"], board_path], "package")
    return {"scores": scores, "board": board, "leaderboard": board_path,
            "mlflow": {"tracking_uri": tracking_uri, "parent_run_id": parent, "artifacts": artifacts, **model}}


def check_upload(upload: str | None, endpoint_url: str | None = None) -> None:
    """`--upload` checked before any work (by `package`, and by `a2 pipeline` before its study): an s3:// URI as a
    whole ("s3://" would otherwise become the prefix "s3:/"), of a bucket that is there (HeadBucket), not found only
    after the seeds are trained and the images decoded. Nothing to check without one."""
    if not upload:
        return
    if not upload.startswith("s3://"):
        raise PackageError(f"--upload must be an s3:// URI, got {upload!r}")
    try:
        parse_s3_uri(upload)
    except StorageError as err:
        raise PackageError(f"--upload: {err}") from None
    try:
        check_storage(upload.rstrip("/") + "/", endpoint_url)
    except StorageError as err:
        raise PackageError(f"--upload {upload}: {err}") from None


def check_replace(replace: bool, upload_prefix: str | None) -> None:
    """--replace with nothing to upload is refused before any work (not after the seeds are trained and the images
    decoded); `upload_prefix`: `_upload_prefix`'s, or `a2 pipeline`'s --upload (None: a local study's, nothing)."""
    if replace and upload_prefix is None:
        raise PackageError("--replace: there is no upload to replace: the study's storage is local and no --upload "
                           "was given; add --upload s3://bucket/prefix/ or leave out --replace")


def _upload_prefix(location, upload: str | None) -> str | None:
    """Where `upload_all` puts the files: `--upload` (`check_upload`), else the study's `package/` prefix when it is
    on S3."""
    if upload:
        if not upload.startswith("s3://"):
            raise PackageError(f"--upload must be an s3:// URI, got {upload!r}")
        return upload.rstrip("/") + "/"
    if location.storage.startswith("s3://"):
        return location.uri("package").rstrip("/") + "/"
    return None


def _stored(uri: str, endpoint_url: str | None) -> dict | None:
    """`launch.storage.stored_object`, its refusal a PackageError: looked up before an upload."""
    try:
        return stored_object(uri, endpoint_url)
    except StorageError as err:
        raise PackageError(f"before uploading to it: {err}") from None


def note_earlier_upload(prefix: str | None, endpoint_url: str | None, verbose: bool = True,
                        replace: bool = False) -> None:
    """Said before any work when the upload prefix already holds a `results.zip`: this run will upload only the same
    bytes (a rerun), so a different package learns now, not after its decoding, that it needs another --upload (or
    --replace); with --replace, that it will replace it."""
    if prefix and _stored(prefix + RESULTS_ZIP, endpoint_url) is not None:
        say(f"package: note: {prefix}{RESULTS_ZIP} exists (an earlier upload); " + (
            f"--replace: this run replaces it unless its {RESULTS_ZIP} is the same bytes" if replace else
            f"this run uploads only if its {RESULTS_ZIP} is the same bytes, else it stops before uploading "
            f"anything: choose another --upload prefix for a different package, or --replace to replace it"),
            verbose)


def upload_all(paths: list[Path], prefix: str | None, endpoint_url: str | None, verbose: bool = True,
               replace: bool = False) -> list[dict]:
    """Verified uploads of `paths` below `prefix` (none without a prefix), never over a different earlier upload
    unless `replace` (--replace).

    `paths[0]` is the submission (results.zip); the files after it describe it (leaderboard.json). Every target is
    looked at before anything is written: one that holds the same bytes (`launch.storage.same_bytes`; a rerun after a
    crash) is left as it is and said so; one that holds other bytes refuses the whole upload, nothing written, in one
    line that names it, or with `replace` is replaced, said with what it held. A describing file whose target
    differs beside a submission that is the same (a leaderboard's "created" time differs on each run) is that
    submission's own, and is replaced. Each entry: {"uri", "size", "sha256", "uploaded"} (False: it was there
    already), plus `upload_file`'s keys when uploaded."""
    if not prefix:
        return []
    # The look decides and the write holds S3 to it (conditional writes): a new object is written only if there is
    # still none, a replaced one only over the object looked at (its ETag), so of two package runs uploading to one
    # prefix in the same seconds the second is refused instead of writing over the first's zip.
    local = [(path, prefix + path.name, file_sha256(path), path.stat().st_size) for path in paths]
    found = [_stored(uri, endpoint_url) for _, uri, _, _ in local]
    same = [same_bytes(f, path, sha, size) for f, (path, _, sha, size) in zip(found, local)]
    for i, ((path, uri, sha, size), there) in enumerate(zip(local, found)):
        if there is None or same[i] or (i > 0 and same[0]) or replace:
            continue
        raise PackageError(
            f"upload refused, nothing uploaded: {uri} already holds a different upload ({there['size']} bytes, "
            f"{_recorded(there, 12)}; this {path.name}: {size} bytes, sha256 {sha[:12]}); choose another prefix "
            f"with --upload, or add --replace to replace it")
    uploads = []
    for i, ((path, uri, sha, size), there, kept) in enumerate(zip(local, found, same)):
        if kept:
            uploads.append({"uri": uri, "size": size, "sha256": sha, "etag": there["etag"], "uploaded": False})
            say(f"package: {uri} already holds this {path.name} (sha256 {sha}): not uploaded again", verbose)
            continue
        try:
            sent = upload_file(path, uri, endpoint_url=endpoint_url, if_absent=there is None,
                               if_match=there and there["etag"])
        except UploadConflict:
            done = [u["uri"] for u in uploads if u["uploaded"]]
            raise PackageError(
                f"upload refused: another upload wrote {uri} meanwhile (after this run looked at it, before it "
                f"wrote); " + (f"this run uploaded only {', '.join(done)}" if done else
                               f"nothing of this run is at {prefix}") +
                ": look at that object, then rerun (with --replace to replace it)") from None
        except StorageError as err:
            raise PackageError(f"upload of {path.name} to {prefix} failed: {err}") from None
        uploads.append({**sent, "uploaded": True})
        if there is None:
            say(f"package: uploaded {path.name} at {uri} (sha256 {sha})", verbose)
        elif i > 0 and same[0]:
            say(f"package: replaced this submission's earlier {path.name} at {uri} (sha256 {sha})", verbose)
        else:
            say(f"package: replaced {uri} (was: {_recorded(there)}, {there['size']} bytes, last modified "
                f"{there['modified']}) with this {path.name} (sha256 {sha})", verbose)
    return uploads


def _recorded(there: dict, digits: int | None = None) -> str:
    """The sha256 an object has recorded (its first `digits`), or that it has none (another tool wrote it)."""
    return f"sha256 {there['sha256'][:digits]}" if there["sha256"] else "no recorded sha256"


def write_manifest(out: Path, location, best: Trial, members: list[Trial], results: dict, delivered: dict,
                   uploads: list[dict], decode_seconds: float, seconds: float) -> dict:
    """`package.json`: what was packaged from where, the headline scores and where everything went."""
    scores, board = delivered["scores"], delivered["board"]
    manifest = {
        "study": location.name, "study_path": location.uri(), "out": str(out), "results_zip": str(results["zip"]),
        "results_files": [str(p) for p in results["files"]], "leaderboard": str(delivered["leaderboard"]),
        "seeds": [m.seed for m in members], "members": [member_entry(m) for m in members],
        "config_hash": best.config_hash, "best_trial": best.trial_id, "fusion": best.config["model"]["fusion"],
        "ensemble_CIDEr": scores["ensemble"].get("CIDEr"),
        "seed_CIDEr": {m.seed: scores[f"seed-{m.seed}"].get("CIDEr") for m in members},
        "seed_mean_CIDEr": board["seed_mean"].get("CIDEr"), "ensemble_gain": board["ensemble"]["gain_over_members"],
        "ensemble_gain_over_chosen": board["ensemble"].get("gain_over_chosen"),
        "mlflow": delivered["mlflow"], "uploads": [{k: u[k] for k in ("uri", "sha256", "size", "uploaded")} for u in uploads],
        "decode_seconds": round(decode_seconds, 2), "seconds": round(seconds, 2),
    }
    atomic_write(out / MANIFEST, json.dumps(manifest, indent=2, default=str) + "\n")
    return manifest
