"""`a2 package --upload ... --replace` and the upload's conditional writes (`launch.package.upload_all`,
`launch.storage.upload_file`), against the session's moto S3 server (tests/s3server.py).

- A different submission at the destination is refused in a line that names `--replace`; with `--replace` it is
  replaced, and the run says what it replaced (its sha256 if recorded, size, last-modified).
- The look (HEAD) and the write are one decision: a new object is written with `If-None-Match: *`, a replaced one
  with `If-Match: <the ETag looked at>`, so another writer between the two is refused (412), its object kept.
- An object another tool wrote has no recorded sha256: the same size and a plain-MD5 ETag equal to the local file's
  MD5 make it the same submission; a multipart ETag (`...-N`) or another MD5 does not.
"""
from __future__ import annotations

import functools
import hashlib
import re
import types

import pytest

from a2core.errors import PackageError
from launch.storage import META_SHA256, META_TOKEN, MiB, UploadConflict, same_bytes, stored_object, upload_file
from tests.s3server import s3_client as new_client, unique_bucket
from tests import test_package_outputs_and_inputs as edges

pytestmark = pytest.mark.outside_ray_group

stubbed = edges.stubbed  # that module's fixture: `package()` with its Ray, torch and MLflow steps stubbed
s3_client = functools.lru_cache(new_client)  # one per endpoint: a boto3 client takes a few tenths of a second


def _files(folder, zip_bytes: bytes, board: bytes = b'{"created": "1"}'):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.zip").write_bytes(zip_bytes)
    (folder / "leaderboard.json").write_bytes(board)
    return [folder / "results.zip", folder / "leaderboard.json"]


def _body(endpoint: str, bucket: str, key: str) -> bytes:
    return s3_client(endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- 1: --replace ----------------------------------------------------------------------------------------------------
def test_the_refusal_names_replace(s3_endpoint, tmp_path):
    from launch.package import upload_all

    bucket = unique_bucket(s3_endpoint)
    prefix = f"s3://{bucket}/subs/"
    upload_all(_files(tmp_path / "a", b"the submitted zip"), prefix, s3_endpoint, verbose=False)
    with pytest.raises(PackageError) as refused:
        upload_all(_files(tmp_path / "b", b"another package's zip"), prefix, s3_endpoint, verbose=False)
    message = str(refused.value)
    assert message.startswith(f"upload refused, nothing uploaded: {prefix}results.zip already holds a different "
                              f"upload (17 bytes, sha256 {_sha(b'the submitted zip')[:12]};")
    assert "--replace" in message and "aws s3 rm" not in message
    assert _body(s3_endpoint, bucket, "subs/results.zip") == b"the submitted zip"


def test_replace_replaces_a_different_submission_and_says_what_it_was(s3_endpoint, tmp_path, capsys):
    from launch.package import upload_all

    bucket = unique_bucket(s3_endpoint)
    prefix = f"s3://{bucket}/subs/"
    upload_all(_files(tmp_path / "a", b"the submitted zip"), prefix, s3_endpoint, verbose=False)
    old = stored_object(prefix + "results.zip", s3_endpoint)
    new = b"another package's zip"
    uploads = upload_all(_files(tmp_path / "b", new, b'{"created": "2"}'), prefix,
                         s3_endpoint, verbose=True, replace=True)
    assert [(u["uri"], u["sha256"], u["uploaded"]) for u in uploads] == [
        (f"{prefix}results.zip", _sha(b"another package's zip"), True),
        (f"{prefix}leaderboard.json", _sha(b'{"created": "2"}'), True)]
    assert _body(s3_endpoint, bucket, "subs/results.zip") == b"another package's zip"
    assert _body(s3_endpoint, bucket, "subs/leaderboard.json") == b'{"created": "2"}'
    out = capsys.readouterr().out
    assert (f"package: replaced {prefix}results.zip (was: sha256 {_sha(b'the submitted zip')}, 17 bytes, "
            f"last modified {old['modified']}) with this results.zip (sha256 {_sha(new)})") in out
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", old["modified"])


def test_replace_of_an_object_without_a_recorded_sha256_says_so(s3_endpoint, tmp_path, capsys):
    from launch.package import upload_all

    bucket = unique_bucket(s3_endpoint)
    s3_client(s3_endpoint).put_object(Bucket=bucket, Key="q/results.zip", Body=b"someone's zip")
    upload_all(_files(tmp_path, b"our zip"), f"s3://{bucket}/q/", s3_endpoint, verbose=True, replace=True)
    assert _body(s3_endpoint, bucket, "q/results.zip") == b"our zip"
    assert f"package: replaced s3://{bucket}/q/results.zip (was: no recorded sha256, 13 bytes, last modified " in (
        capsys.readouterr().out)


def test_a2_package_replace_end_to_end(stubbed, tmp_path, s3_endpoint, capsys):
    """`a2 package --replace` parses into `package(replace=True)`: a second package with another --alg to the prefix
    of the first exits 0, said so, and its zip is the one there (without it: exit 2, tests/test_package_audit77)."""
    from launch.cli import main

    bucket = unique_bucket(s3_endpoint)
    upload = f"s3://{bucket}/subs/"
    args = ["package", edges.NAME, "--workers", "0", "--upload", upload, "--s3-endpoint-url", s3_endpoint]
    assert main([*args, "--out", str(tmp_path / "one"), "--alg", "first"]) == 0
    first = _body(s3_endpoint, bucket, "subs/results.zip")
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "three"), "--alg", "second", "--replace"]) == 0
    out = capsys.readouterr().out
    replaced = _body(s3_endpoint, bucket, "subs/results.zip")
    assert replaced != first and replaced == (tmp_path / "three" / "results.zip").read_bytes()
    assert f"package: replaced {upload}results.zip (was: sha256 {_sha(first)}, {len(first)} bytes" in out


def test_a2_pipeline_replace_with_nothing_to_upload_is_refused_before_the_study(tmp_path, monkeypatch, capsys):
    """`a2 pipeline --replace` (a local study, no --upload): refused in one line, exit 2, before the study runs (the
    refusal `a2 package` gives, not after hours of training); with --upload it reaches `package(replace=True)`."""
    import launch.commands.pipeline as pipeline
    from launch.cli import main

    ran = []
    monkeypatch.setattr(pipeline, "run_or_reuse", lambda *a, **k: ran.append(True) or {})
    monkeypatch.chdir(tmp_path)
    assert main(["pipeline", f"storage={tmp_path / 'st'}", "--replace"]) == 2
    err = capsys.readouterr().err
    assert "--replace: there is no upload to replace" in err and "add --upload s3://bucket/prefix/" in err
    assert ran == []

    class Packaged(Exception):
        pass

    def packaging(*args, **kwargs):
        raise Packaged(kwargs)

    monkeypatch.setattr(pipeline, "run_or_reuse", lambda *a, **k: {"trials": [], "complete": True})
    monkeypatch.setattr(pipeline, "exit_code", lambda summary: 0)
    monkeypatch.setattr(pipeline.StudyRecord, "load", classmethod(lambda cls, *a, **k: types.SimpleNamespace(
        study=lambda: None)))
    monkeypatch.setattr(pipeline, "build_report", lambda *a, **k: (_ for _ in ()).throw(PackageError("no report")))
    monkeypatch.setattr(pipeline, "package", packaging)
    monkeypatch.setattr(pipeline, "check_upload", lambda upload: None)  # no bucket to look up here
    with pytest.raises(Packaged) as packaged:
        main(["pipeline", f"storage={tmp_path / 'st'}", "--replace", "--upload", "s3://subs-bucket/p/"])
    assert packaged.value.args[0]["replace"] is True and packaged.value.args[0]["upload"] == "s3://subs-bucket/p/"


# -- 2: conditional writes -------------------------------------------------------------------------------------------
def _racing(monkeypatch, endpoint: str, bucket: str, key: str, body: bytes) -> None:
    """Another writer puts `body` at `key` between upload_all's HEAD and its first upload."""
    import launch.package as package

    real = package.upload_file

    def racing(*args, **kwargs):
        s3_client(endpoint).put_object(Bucket=bucket, Key=key, Body=body)
        monkeypatch.setattr(package, "upload_file", real)
        return real(*args, **kwargs)

    monkeypatch.setattr(package, "upload_file", racing)


def test_a_writer_between_the_look_and_the_upload_is_not_overwritten(s3_endpoint, tmp_path, monkeypatch):
    from launch.package import upload_all

    bucket = unique_bucket(s3_endpoint)
    prefix = f"s3://{bucket}/subs/"
    _racing(monkeypatch, s3_endpoint, bucket, "subs/results.zip", b"the other run's zip")
    with pytest.raises(PackageError) as refused:
        upload_all(_files(tmp_path, b"our zip"), prefix, s3_endpoint, verbose=False)
    assert str(refused.value) == (
        f"upload refused: another upload wrote {prefix}results.zip meanwhile (after this run looked at it, before "
        f"it wrote); nothing of this run is at {prefix}: look at that object, then rerun (with --replace to "
        f"replace it)")
    assert _body(s3_endpoint, bucket, "subs/results.zip") == b"the other run's zip"
    assert "Contents" not in s3_client(s3_endpoint).list_objects_v2(Bucket=bucket, Prefix="subs/leaderboard")


def test_replace_does_not_overwrite_what_another_writer_put_meanwhile(s3_endpoint, tmp_path, monkeypatch):
    from launch.package import upload_all

    bucket = unique_bucket(s3_endpoint)
    prefix = f"s3://{bucket}/subs/"
    upload_all(_files(tmp_path / "a", b"the submitted zip"), prefix, s3_endpoint, verbose=False)
    _racing(monkeypatch, s3_endpoint, bucket, "subs/results.zip", b"the other run's zip")
    with pytest.raises(PackageError, match=rf"^upload refused: another upload wrote {prefix}results.zip meanwhile"):
        upload_all(_files(tmp_path / "b", b"our zip"), prefix, s3_endpoint, verbose=False, replace=True)
    assert _body(s3_endpoint, bucket, "subs/results.zip") == b"the other run's zip"
    assert _body(s3_endpoint, bucket, "subs/leaderboard.json") == b'{"created": "1"}'


@pytest.mark.parametrize("size", [100, 6 * MiB], ids=["single-put", "multipart"])
def test_upload_file_if_absent_refuses_an_existing_object(s3_endpoint, tmp_path, size):
    bucket = unique_bucket(s3_endpoint)
    s3_client(s3_endpoint).put_object(Bucket=bucket, Key="k", Body=b"theirs")
    path = tmp_path / "f"
    path.write_bytes(b"x" * size)
    with pytest.raises(UploadConflict) as refused:
        upload_file(path, f"s3://{bucket}/k", endpoint_url=s3_endpoint, part_size=5 * MiB, if_absent=True)
    assert refused.value.uri == f"s3://{bucket}/k"
    assert _body(s3_endpoint, bucket, "k") == b"theirs"
    done = upload_file(path, f"s3://{bucket}/new", endpoint_url=s3_endpoint, part_size=5 * MiB, if_absent=True)
    assert done["sha256"] == _sha(b"x" * size) and done["size"] == size


def test_upload_file_if_match_replaces_only_the_object_seen(s3_endpoint, tmp_path):
    bucket = unique_bucket(s3_endpoint)
    client = s3_client(s3_endpoint)
    client.put_object(Bucket=bucket, Key="k", Body=b"seen")
    seen = client.head_object(Bucket=bucket, Key="k")["ETag"]
    client.put_object(Bucket=bucket, Key="k", Body=b"written meanwhile")
    path = tmp_path / "f"
    path.write_bytes(b"ours")
    with pytest.raises(UploadConflict):
        upload_file(path, f"s3://{bucket}/k", endpoint_url=s3_endpoint, if_match=seen)
    assert _body(s3_endpoint, bucket, "k") == b"written meanwhile"
    now = client.head_object(Bucket=bucket, Key="k")["ETag"]
    upload_file(path, f"s3://{bucket}/k", endpoint_url=s3_endpoint, if_match=now)
    assert _body(s3_endpoint, bucket, "k") == b"ours"


def test_a_retried_conditional_put_whose_first_try_landed_is_ours(s3_endpoint, tmp_path):
    """A PUT that landed but whose answer was lost is sent again by botocore; the second try fails its own
    If-None-Match (412). The object there is this upload's (its token): the upload succeeded, nothing is removed."""
    from launch.storage import make_client

    bucket = unique_bucket(s3_endpoint)
    client, resent = make_client(s3_endpoint), []

    def lost_answer(response, attempts, **_):
        if response is not None and response[0].status_code == 200 and attempts == 1:
            resent.append(attempts)
            return 0  # retry at once, as after a dropped connection
        return None

    client.meta.events.register_first("needs-retry.s3.PutObject", lost_answer)
    path = tmp_path / "f"
    path.write_bytes(b"ours")
    done = upload_file(path, f"s3://{bucket}/k", client=client, if_absent=True)
    assert resent == [1] and done["sha256"] == _sha(b"ours")
    assert _body(s3_endpoint, bucket, "k") == b"ours"


def test_a_multipart_replace_completes_only_if_match(s3_endpoint, tmp_path):
    """A multipart upload's condition goes on its CompleteMultipartUpload. moto 5.2 ignores If-Match there (AWS
    honours it since Nov 2024), so this checks the request carries it, and that the caller's client is left
    without the hook afterwards."""
    from launch.storage import make_client

    bucket = unique_bucket(s3_endpoint)
    client, sent = make_client(s3_endpoint), []
    client.meta.events.register("before-send.s3.CompleteMultipartUpload",
                                lambda request, **_: sent.append(request.headers.get("If-Match")))
    client.put_object(Bucket=bucket, Key="k", Body=b"seen")
    seen = client.head_object(Bucket=bucket, Key="k")["ETag"]
    path = tmp_path / "f"
    path.write_bytes(b"x" * (6 * MiB))
    upload_file(path, f"s3://{bucket}/k", client=client, part_size=5 * MiB, if_match=seen)
    upload_file(path, f"s3://{bucket}/k2", client=client, part_size=5 * MiB)  # unconditional: no hook left
    assert [h.decode() if isinstance(h, bytes) else h for h in sent] == [seen, None]


# -- 3: an object without a recorded sha256 --------------------------------------------------------------------------
def test_an_object_another_tool_wrote_with_the_same_bytes_is_the_same_submission(s3_endpoint, tmp_path, capsys):
    from launch.package import upload_all

    bucket = unique_bucket(s3_endpoint)
    client = s3_client(s3_endpoint)
    client.put_object(Bucket=bucket, Key="p/results.zip", Body=b"the zip")  # `aws s3 cp`: no sha256 metadata
    paths = _files(tmp_path, b"the zip")
    uploads = upload_all(paths, f"s3://{bucket}/p/", s3_endpoint, verbose=True)
    assert [u["uploaded"] for u in uploads] == [False, True]
    head = client.head_object(Bucket=bucket, Key="p/results.zip")
    assert META_TOKEN not in head["Metadata"] and META_SHA256 not in head["Metadata"]  # left as it was
    assert f"s3://{bucket}/p/results.zip already holds this results.zip" in capsys.readouterr().out


def test_same_size_other_md5_or_a_multipart_etag_is_different(s3_endpoint, tmp_path):
    from launch.package import upload_all

    bucket = unique_bucket(s3_endpoint)
    s3_client(s3_endpoint).put_object(Bucket=bucket, Key="p/results.zip", Body=b"zip 1")
    with pytest.raises(PackageError, match=r"already holds a different upload \(5 bytes, no recorded sha256;"):
        upload_all(_files(tmp_path, b"zip 2"), f"s3://{bucket}/p/", s3_endpoint, verbose=False)
    assert _body(s3_endpoint, bucket, "p/results.zip") == b"zip 1"

    path = tmp_path / "results.zip"
    md5 = hashlib.md5(b"zip 2").hexdigest()
    facts = (_sha(b"zip 2"), 5)
    assert same_bytes({"size": 5, "sha256": None, "etag": f'"{md5}"'}, path, *facts)
    assert not same_bytes({"size": 5, "sha256": None, "etag": f'"{md5}-1"'}, path, *facts)  # multipart: no MD5
    assert not same_bytes({"size": 6, "sha256": None, "etag": f'"{md5}"'}, path, *facts)
    assert not same_bytes({"size": 5, "sha256": _sha(b"zip 1"), "etag": f'"{md5}"'}, path, *facts)  # sha256 rules
    assert same_bytes({"size": 5, "sha256": _sha(b"zip 2"), "etag": '"x-3"'}, path, *facts)
    assert not same_bytes(None, path, *facts)
