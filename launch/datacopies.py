"""The S3 copies of a study's data that a cluster's nodes fetch as they start (`a2 data fetch SOURCE TARGET` in the
cluster-launcher file's setup commands), and whether each is there and the same version as this machine's copy:
`a2 study validate --cluster CLUSTER_YAML`. Imports no pyarrow or boto3 until there is a bucket to ask (validate
stays light)."""
from __future__ import annotations

import os
import posixpath
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from a2core.config import ConfigError, load_yaml
from a2core.data import prepared
from a2core.errors import DataError, StorageError
from launch.defaults import ENDPOINT_ENV_VARS
from launch.placeholders import refuse_placeholder
from launch.spec import DATA_PATHS

# The cluster file's lists of shell commands that a node runs as it starts (Ray's cluster-launcher keys).
SETUP_COMMANDS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands")
CLUSTER_CHECKOUT = "~/a2tune"  # the cluster's copy of the repository when its file_mounts do not name one
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}


@dataclass(frozen=True)
class ClusterCopy:
    """One of the study's data paths (`key`, resolved to `local` on this machine) as a cluster's nodes get it:
    `a2 data fetch uri TARGET`, TARGET being the same path in the cluster's copy of the repository."""
    key: str
    uri: str
    local: str
    endpoint_url: str | None = None


def fetch_commands(cluster: dict) -> list[tuple[str, str, str | None]]:
    """(SOURCE, TARGET, endpoint or None) of every `a2 data fetch` (or `python -m launch.cli data fetch`) in the
    cluster file's setup commands. A relative TARGET is resolved as the node's shell does: against the folder of an
    earlier `cd` in the same command, else the home folder (where Ray runs each setup command). The endpoint is the
    command's `--endpoint-url`, else an S3 endpoint variable set for it (`VAR=... a2 data fetch`, `export VAR=...`)."""
    found = []
    for key in SETUP_COMMANDS:
        commands = cluster.get(key) or []
        for command in commands if isinstance(commands, list) else [commands]:
            # the shell drops a backslash-newline (a command continued on the next line); shlex keeps the newline
            words = shlex.shlex(str(command).replace("\\\n", ""), posix=True, punctuation_chars=True)
            words.whitespace_split = True
            try:
                words = list(words)
            except ValueError:  # unbalanced quotes: not a command a node could run either
                continue
            cwd, exported = "~", {}  # each setup command starts in the home folder, in a shell of its own
            simple: list[str] = []
            for word in [*words, ";"]:
                if word not in SHELL_OPERATORS:
                    simple.append(word)
                    continue
                cwd = _one_command(simple, cwd, exported, found)
                simple = []
    return found


def _one_command(words: list[str], cwd: str, exported: dict, found: list) -> str:
    """Read one simple command of a setup command: a `cd`, an `export` (into `exported`), or a fetch (added to
    `found`); returns the working folder after it."""
    assigned = dict(exported)
    first = True  # the command's name: the first word that assigns no variable
    for start, word in enumerate(words):
        if first and _ASSIGNMENT.fullmatch(word):
            assigned[word.partition("=")[0]] = word.partition("=")[2]
            continue
        if first and word == "cd":
            return _resolved(cwd, words[start + 1] if start + 1 < len(words) else "~")
        if first and word == "export":
            exported.update(w.partition("=")[::2] for w in words[start + 1:] if _ASSIGNMENT.fullmatch(w))
            return cwd
        if os.path.basename(word) == "env":  # `env VAR=... a2 data fetch`: the next word names the command again
            continue
        first = False
        if os.path.basename(word) == "a2" and words[start + 1:start + 3] == ["data", "fetch"]:
            rest = iter(words[start + 3:])
        elif word == "-m" and words[start + 1:start + 4] == ["launch.cli", "data", "fetch"]:
            rest = iter(words[start + 4:])
        else:
            continue
        positional, endpoint_url = [], None
        for arg in rest:
            if arg == "--endpoint-url":
                endpoint_url = next(rest, None)
            elif arg.startswith("--endpoint-url="):
                endpoint_url = arg.partition("=")[2]
            elif not arg.startswith("-"):
                positional.append(arg)
        if len(positional) >= 2:
            endpoint_url = endpoint_url or next((assigned[v] for v in ENDPOINT_ENV_VARS if assigned.get(v)), None)
            found.append((positional[0], _resolved(cwd, positional[1]), endpoint_url))
        return cwd
    return cwd


_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.S)


def _resolved(cwd: str, path: str) -> str:
    """`path` as a shell in the folder `cwd` names it: absolute, `~/...` and `$HOME/...` as they are."""
    if path.startswith(("/", "~", "$HOME", "${HOME}")):
        return path
    return posixpath.join(cwd, path)


def cluster_checkout(cluster: dict) -> str:
    """Where the cluster's nodes hold this repository: the file_mounts target of ".", else ~/a2tune."""
    mounts = cluster.get("file_mounts") or {}
    return next((str(target) for target, source in mounts.items() if str(source).rstrip("/") in (".", "")),
                CLUSTER_CHECKOUT)


def _home_spelled(path: str) -> str:
    """`$HOME/x` and `${HOME}/x` as `~/x`, normalised: a setup command may spell the home either way."""
    for home in ("$HOME", "${HOME}"):
        if path == home or path.startswith(home + "/"):
            path = "~" + path[len(home):]
    return posixpath.normpath(path)


def cluster_copies(cluster: str | Path, spec, root: str) -> list[ClusterCopy]:
    """The study's data paths that the cluster file's setup commands fetch from S3, matched by their path relative
    to the repository (here `root`, on the nodes the cluster's copy). A fetch of the placeholder bucket is refused
    (ConfigError naming the file), as the study's own placeholder storage is; a fetch of a path the study does not
    read is left alone."""
    raw = load_yaml(cluster)
    checkout = _home_spelled(cluster_checkout(raw))
    fetched = {}  # path relative to the repository -> (S3 URI, endpoint)
    for source, target, endpoint_url in fetch_commands(raw):
        if not source.startswith("s3://"):
            continue
        try:
            refuse_placeholder(source)
        except StorageError as error:
            raise ConfigError("setup_commands", f"a2 data fetch {error}", str(cluster)) from None
        target = _home_spelled(target)
        if target.startswith(checkout + "/"):
            fetched[target[len(checkout) + 1:]] = (source, endpoint_url)
    copies = []
    for key in DATA_PATHS:
        section, _, name = key.partition(".")
        local = getattr(spec, section).get(name)  # spec.data, spec.train
        if not isinstance(local, str) or "://" in local:
            continue
        relative = Path(os.path.relpath(local, root)).as_posix()
        if relative in fetched:
            uri, endpoint_url = fetched[relative]
            copies.append(ClusterCopy(key, uri, local, endpoint_url))
    return copies


def copy_problem(copy: ClusterCopy) -> str | None:
    """What is wrong with the S3 copy (missing, another version than the local copy, unreadable), in one line naming
    the study key, the URI, what differs and the command that fixes it; None when it is there and the same."""
    from launch.storage import open_location  # pyarrow and boto3: only when there is a bucket to ask

    local = Path(copy.local)
    shown = os.path.relpath(local) if not os.path.relpath(local).startswith("..") else str(local)
    fix = f"upload it: a2 data push {shown} {copy.uri}"
    where = f"{copy.key}: {copy.uri} (the cluster's copy)"
    try:
        source = open_location(copy.uri, copy.endpoint_url)
        manifest = source.join(prepared.MANIFEST).read_text()
        if manifest is not None:
            return _store_problem(where, manifest, source, local, shown, fix)
        if source.stamp() is None:
            return f"{where}: no such store or file; {fix}"
        size, sha256 = source.stored_digest()
    except StorageError as error:
        return f"{copy.key}: {error}"
    if not local.exists():
        return None
    if local.is_dir():
        return f"{where} is a file, the local copy {shown} a folder; {fix}"
    if sha256 is None:
        return f"{where} has no SHA-256 stored with it (not uploaded by `a2 data push`: no node can verify it); {fix}"
    local_size = local.stat().st_size
    if local_size != size:
        return f"{where} is {size} bytes with SHA-256 {sha256}, the local copy {shown} {local_size} bytes; {fix}"
    local_sha256 = prepared.file_sha256(local)
    if local_sha256 != sha256:
        return f"{where} has SHA-256 {sha256}, the local copy {shown} {local_sha256}; {fix}"
    return None


def _store_problem(where: str, manifest: str, source, local: Path, shown: str, fix: str) -> str | None:
    """The S3 copy is a prepared store (its manifest's text, `source` its folder): every file the manifest lists
    there with the size and SHA-256 it records (what each node's `a2 data fetch` checks after downloading it), and
    the same checksum as the local store's, if any."""
    try:
        parsed = prepared.parse_manifest(manifest, prepared.MANIFEST)
    except DataError as error:
        return f"{where}: {error}; {fix}"
    for name, entry in sorted(parsed["files"].items()):
        try:
            size, sha256 = source.join(name).stored_digest()
        except StorageError as error:
            return f"{where}: its manifest lists {name}, which cannot be read there ({error}); {fix}"
        if size != entry["size"] or (sha256 is not None and sha256 != entry["sha256"]):
            got = f"{size} bytes" + (f" with SHA-256 {sha256}" if sha256 is not None else "")
            return (f"{where}: {name} is {got}, its manifest says {entry['size']} bytes with SHA-256 "
                    f"{entry['sha256']} (an unfinished or mixed upload: every node's fetch would refuse it); {fix}")
    checksum = parsed["checksum"]
    if not local.exists():
        return None
    if not prepared.is_prepared(local):
        return f"{where} is a prepared store, the local copy {shown} is not one; {fix}"
    try:
        mine = prepared.read_manifest(local)["checksum"]
    except DataError as error:
        return f"{where}: the local copy: {error}"
    if mine != checksum:
        return f"{where} is store {checksum}, the local copy {shown} store {mine} (another version); {fix}"
    return None
