"""A checksum file damaged so that it records no SHA-256 any more (a bit flipped a hex digit into another
character): read as "no checksum", it let the checkpoint beside it through unchecked, by every reader. It is now
damaged too, named by the checkpoint's loader and by `a2 study check`'s label."""
from __future__ import annotations

import pytest

from a2core.checksum import checksum_path, checksum_problem, write_checksum
from a2core.errors import CheckpointError


def checkpoint(tmp_path, flip: str | None):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"weights" * 100)
    digest = write_checksum(path)
    if flip is not None:  # its first hex digit, as the bit flip leaves it
        checksum_path(path).write_text(flip + digest[1:] + "  checkpoint.pt\n")
    return path, digest


@pytest.mark.parametrize("flip", ["q", "\u00e9", " "])
def test_a_checksum_file_that_records_no_sha256_is_damaged(tmp_path, flip):
    path, _ = checkpoint(tmp_path, flip)
    found = checksum_problem(path, checksum_path(path).read_text(errors="replace"), str(path))
    assert found == (f"{path}: its checksum file (checkpoint.pt.sha256) records no SHA-256: damaged since it was "
                     f"written, so the checkpoint cannot be checked; restore both from a copy")


def test_a_whole_checksum_and_none_at_all_are_as_before(tmp_path):
    path, digest = checkpoint(tmp_path, None)
    assert checksum_problem(path, checksum_path(path).read_text(), str(path)) is None
    assert checksum_problem(path, None, str(path)) is None  # a checkpoint from before checksums
    checksum_path(path).write_text(("0" if digest[0] != "0" else "1") + digest[1:] + "  checkpoint.pt\n")
    assert "damaged since it was written: its SHA-256 is" in checksum_problem(
        path, checksum_path(path).read_text(), str(path))


def test_the_checkpoint_loader_refuses_a_checkpoint_whose_checksum_file_records_none(tmp_path):
    import torch

    from a2core import checkpoint as ckpt

    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {}, "config": {}, "vocab": [], "format": ckpt.FORMAT}, path)
    digest = write_checksum(path)
    assert ckpt.load(path)["vocab"] == []
    checksum_path(path).write_text("z" + digest[1:] + "  checkpoint.pt\n")
    with pytest.raises(CheckpointError, match="records no SHA-256"):
        ckpt.load(path)
