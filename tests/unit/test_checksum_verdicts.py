"""Which of the two disagrees when a checkpoint file and its checksum file do: the data, the
checksum file, or both (canzona_patches/checkpoints/checksums.py), told apart with the list of
every checksum the first rank writes at commit (SHA256SUMS)."""

from __future__ import annotations

from pathlib import Path

import pytest

from canzona_patches.checkpoints.checksums import (
    MANIFEST,
    file_digest,
    first_mismatch,
    record,
    record_small_files,
    sidecar,
)

pytestmark = pytest.mark.quick


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    """A committed checkpoint of one data file and one small file, with its checksums."""
    data = tmp_path / "__0_0.distcp"
    data.write_bytes(bytes(range(256)) * 64)
    record(data, file_digest(data))  # what the writer's stream records
    (tmp_path / "common.pt").write_bytes(b"common")
    record_small_files(tmp_path)  # the commit: the small file's checksum, then the list
    assert (tmp_path / "checksums" / MANIFEST).is_file()
    assert first_mismatch(tmp_path, 0, 1) is None
    return tmp_path


def _edit_sidecar(checkpoint: Path) -> Path:
    listing = sidecar(checkpoint / "__0_0.distcp")
    listing.write_text(f"{'0' * 64}  __0_0.distcp\n")
    return listing


def _flip_a_byte(checkpoint: Path) -> None:
    data = checkpoint / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_an_edited_checksum_file_is_not_called_a_corrupt_data_file(checkpoint: Path) -> None:
    listing = _edit_sidecar(checkpoint)
    verdict = first_mismatch(checkpoint, 0, 1)
    assert verdict.startswith(f"{listing} was changed after the save: {checkpoint / '__0_0.distcp'} still has the "
                              "SHA-256 the save recorded"), verdict
    assert "the data is intact" in verdict and "is corrupt" not in verdict


def test_a_changed_data_file_is_corrupt(checkpoint: Path) -> None:
    _flip_a_byte(checkpoint)
    verdict = first_mismatch(checkpoint, 0, 1)
    assert verdict.startswith(f"{checkpoint / '__0_0.distcp'} is corrupt: its SHA-256 is"), verdict
    assert f"and {MANIFEST} agrees" in verdict


def test_both_changed(checkpoint: Path) -> None:
    _flip_a_byte(checkpoint)
    _edit_sidecar(checkpoint)
    verdict = first_mismatch(checkpoint, 0, 1)
    assert "__0_0.distcp and " in verdict and "both changed after the save" in verdict, verdict


def test_without_the_list_the_verdict_says_it_cannot_tell(checkpoint: Path) -> None:
    (checkpoint / "checksums" / MANIFEST).unlink()  # a checkpoint saved before the list existed
    _edit_sidecar(checkpoint)
    verdict = first_mismatch(checkpoint, 0, 1)
    assert "is corrupt" in verdict and f"no {MANIFEST} to tell which of the two changed" in verdict
