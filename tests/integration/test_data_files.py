"""A ``.bin`` cut short while a job maps it is named in one line instead of SIGBUS
(``canzona_patches/integration/data_files.py``), on Megatron-Core's own ``IndexedDataset``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy
import pytest

from canzona_patches.errors import CanzonaRankError
from canzona_patches.integration.data_files import checked_bin_read, data_worker_died_words
from megatron.core.datasets import indexed_dataset
from megatron.core.datasets.indexed_dataset import IndexedDataset

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "data" / "demo" / "demo_text_document"


@pytest.fixture
def dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, IndexedDataset]:
    if not Path(f"{DEMO}.idx").is_file():
        import subprocess
        import sys

        subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_demo_data.py"), "--output-dir",
                        str(DEMO.parent)], check=True, capture_output=True)
    prefix = tmp_path / "copy_text_document"
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{DEMO}{suffix}", f"{prefix}{suffix}")
    reader = indexed_dataset._MMapBinReader
    monkeypatch.setattr(reader, "read", checked_bin_read(reader.read))  # the registry's row, for this test
    return prefix, IndexedDataset(str(prefix), mmap=True)


def test_reads_are_as_before_while_the_file_is_whole(dataset) -> None:
    prefix, data = dataset
    last = len(data) - 1
    expected = numpy.fromfile(f"{prefix}.bin", dtype=data.index.dtype)[-len(data[last]):]
    assert numpy.array_equal(data[last], expected)


def test_a_bin_cut_short_under_the_job_is_named(dataset) -> None:
    prefix, data = dataset
    os.truncate(f"{prefix}.bin", 4096)
    assert len(data[0]) and data[0][:1].size  # what lies inside the new end still reads
    with pytest.raises(CanzonaRankError) as refused:
        data[len(data) - 1]
    line = str(refused.value)
    assert line.startswith(f"{prefix}.bin changed while the job read it: it holds 4096 bytes now") and "\n" not in line
    assert "resume from the last checkpoint" in line


def test_a_data_loader_worker_killed_by_sigbus_is_named() -> None:
    error = RuntimeError("DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that ...")
    words = data_worker_died_words(error, ["0.3", "/data/a_text_document", "0.7", "/data/b_text_document"])
    assert words.startswith("a DataLoader worker died of SIGBUS reading the data: /data/a_text_document.bin, "
                            "/data/b_text_document.bin was cut short")
    assert data_worker_died_words(RuntimeError("something else"), None) is None
