"""Audit of `a2 package`'s upload (`launch.package.upload_all`): an upload to an S3 prefix that holds an earlier
package replaced that package's results.zip without a word, so a team lost the zip it had submitted. Now the same
bytes again (a rerun after a crash) are left as they are and said so, and other bytes are refused before anything is
written, in one line naming the object. Runs against the session's moto S3 server (tests/s3server.py)."""
from __future__ import annotations

import hashlib

import pytest

from a2core.errors import PackageError
from launch.storage import META_TOKEN
from tests.s3server import s3_client, unique_bucket
from tests import test_package_outputs_and_inputs as edges

pytestmark = pytest.mark.outside_ray_group

stubbed = edges.stubbed  # that module's fixture: `package()` with its Ray, torch and MLflow steps stubbed


def _files(folder, zip_bytes: bytes, board: bytes = b'{"created": "1"}'):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.zip").write_bytes(zip_bytes)
    (folder / "leaderboard.json").write_bytes(board)
    return [folder / "results.zip", folder / "leaderboard.json"]


def _objects(endpoint: str, bucket: str) -> dict[str, tuple[bytes, str]]:
    """{key: (bytes, the upload_file call's token in its metadata)} of every object in `bucket`."""
    client, out = s3_client(endpoint), {}
    for listed in client.list_objects_v2(Bucket=bucket).get("Contents", []):
        got = client.get_object(Bucket=bucket, Key=listed["Key"])
        out[listed["Key"]] = (got["Body"].read(), got["Metadata"].get(META_TOKEN))
    return out


def test_an_upload_never_replaces_a_different_earlier_submission(s3_endpoint, tmp_path):
    """A second package uploaded to the prefix of the first replaced its results.zip and leaderboard. Refused,
    nothing written (not even the leaderboard), in one line naming the object and both digests."""
    from launch.package import upload_all

    bucket = unique_bucket(s3_endpoint)
    prefix = f"s3://{bucket}/subs/"
    upload_all(_files(tmp_path / "a", b"the submitted zip"), prefix, s3_endpoint, verbose=False)
    before = _objects(s3_endpoint, bucket)
    other = _files(tmp_path / "b", b"another package's zip", b'{"created": "2"}')
    with pytest.raises(PackageError) as refused:
        upload_all(other, prefix, s3_endpoint, verbose=False)
    message = str(refused.value)
    old_sha = hashlib.sha256(b"the submitted zip").hexdigest()[:12]
    new_sha = hashlib.sha256(b"another package's zip").hexdigest()[:12]
    assert "\n" not in message
    assert message == (f"upload refused, nothing uploaded: {prefix}results.zip already holds a different upload "
                       f"(17 bytes, sha256 {old_sha}; this results.zip: 21 bytes, sha256 {new_sha}); choose "
                       f"another prefix with --upload, or add --replace to replace it")
    assert _objects(s3_endpoint, bucket) == before  # both objects as the first package left them
    assert before["subs/results.zip"][0] == b"the submitted zip"


def test_an_identical_reupload_is_a_no_op_that_says_so(s3_endpoint, tmp_path, capsys):
    """A rerun after a crash uploads the same bytes: they were written again (a new object); now they are left as
    they are, the run says so, and its entries say `uploaded: False` with the object's digest and size."""
    from launch.package import upload_all

    bucket = unique_bucket(s3_endpoint)
    prefix = f"s3://{bucket}/p/"
    paths = _files(tmp_path, b"same zip bytes")
    upload_all(paths, prefix, s3_endpoint, verbose=False)
    before = _objects(s3_endpoint, bucket)
    again = upload_all(paths, prefix, s3_endpoint, verbose=True)
    assert _objects(s3_endpoint, bucket) == before  # the same tokens: nothing was written again
    sha = hashlib.sha256(b"same zip bytes").hexdigest()
    assert [(u["uri"], u["size"], u["sha256"], u["uploaded"]) for u in again] == [
        (f"{prefix}results.zip", 14, sha, False),
        (f"{prefix}leaderboard.json", 16, hashlib.sha256(b'{"created": "1"}').hexdigest(), False)]
    out = capsys.readouterr().out
    assert f"package: {prefix}results.zip already holds this results.zip (sha256 {sha}): not uploaded again" in out


def test_a_leaderboard_goes_with_its_submission(s3_endpoint, tmp_path, capsys):
    """leaderboard.json differs on every run (its "created" time): beside the same results.zip it is this
    submission's own and is replaced, said so. A different leaderboard at a prefix whose zip is not there (someone
    else's file) was replaced and the zip uploaded beside it; now refused, nothing written."""
    from launch.package import upload_all

    bucket = unique_bucket(s3_endpoint)
    s3_client(s3_endpoint).put_object(Bucket=bucket, Key="q/leaderboard.json", Body=b"someone's notes")
    with pytest.raises(PackageError, match=rf"^upload refused, nothing uploaded: s3://{bucket}/q/leaderboard.json "
                                           r"already holds a different upload \(15 bytes, no recorded sha256;"):
        upload_all(_files(tmp_path / "c", b"zip"), f"s3://{bucket}/q/", s3_endpoint, verbose=False)
    assert _objects(s3_endpoint, bucket)["q/leaderboard.json"][0] == b"someone's notes"
    assert "q/results.zip" not in _objects(s3_endpoint, bucket)

    prefix = f"s3://{bucket}/p/"
    upload_all(_files(tmp_path / "a", b"zip"), prefix, s3_endpoint, verbose=False)
    rerun = upload_all(_files(tmp_path / "b", b"zip", b'{"created": "later"}'), prefix, s3_endpoint)
    assert [u["uploaded"] for u in rerun] == [False, True]
    assert _objects(s3_endpoint, bucket)["p/leaderboard.json"][0] == b'{"created": "later"}'
    assert f"package: replaced this submission's earlier leaderboard.json at {prefix}leaderboard.json" in (
        capsys.readouterr().out)


def test_a2_package_to_a_used_prefix_warns_first_and_exits_2_keeping_the_submitted_zip(
        stubbed, tmp_path, s3_endpoint, capsys):
    """`a2 package` end to end (its training, decoding and MLflow steps stubs): a second package of the study with
    another --alg (other bytes) to the prefix of the first is told before its work that the prefix holds a
    results.zip, then exits 2 with the refusal, the first zip still there; the same package again is a no-op."""
    from launch.cli import main

    bucket = unique_bucket(s3_endpoint)
    upload = f"s3://{bucket}/subs/"
    args = ["package", edges.NAME, "--workers", "0", "--upload", upload, "--s3-endpoint-url", s3_endpoint]
    assert main([*args, "--out", str(tmp_path / "one"), "--alg", "first"]) == 0
    submitted = _objects(s3_endpoint, bucket)["subs/results.zip"]
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "two"), "--alg", "second"]) == 2
    out, err = capsys.readouterr()
    assert (f"package: note: {upload}results.zip exists (an earlier upload); this run uploads only if its "
            f"results.zip is the same bytes") in out
    assert f"upload refused, nothing uploaded: {upload}results.zip already holds a different upload" in err
    assert _objects(s3_endpoint, bucket)["subs/results.zip"] == submitted
    assert stubbed["calls"] == ["members", "decode", "deliver"] * 2

    assert main([*args, "--out", str(tmp_path / "three"), "--alg", "first"]) == 0
    out = capsys.readouterr().out
    assert f"was there:   {upload}results.zip" in out and f"uploaded:    {upload}leaderboard.json" not in out
    assert _objects(s3_endpoint, bucket)["subs/results.zip"] == submitted
