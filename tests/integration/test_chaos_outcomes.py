"""tools/chaos.py's reading of a run's output: a traceback is a rank's whether or not torch put
``[rankN]: `` before its lines (it does once the process group started), torchrun's own report
is not one, and the error line is found under the prefix too."""

from __future__ import annotations

import pytest

from tools.chaos import ERROR_LINE, RANK_PREFIX, rank_traceback

pytestmark = pytest.mark.quick

RANK_TRACEBACK = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/pretrain_gpt.py", line 473, in <module>
[rank0]:     sys.exit(main())
[rank0]:   File "/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", line 3467, in wait
[rank0]:     work.wait()
[rank0]: RuntimeError: Application timeout caused pair closure
"""
TORCHRUN_REPORT = """\
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.12/site-packages/torch/distributed/run.py", line 1142, in <module>
    main()
  File "/venv/lib/python3.12/site-packages/torch/distributed/launcher/api.py", line 386, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_a_traceback_behind_the_rank_prefix_is_a_ranks() -> None:
    assert rank_traceback(RANK_TRACEBACK)
    assert rank_traceback(RANK_TRACEBACK.replace("[rank0]: ", ""))
    assert rank_traceback(RANK_TRACEBACK.replace("[rank0]", "[default3]"))


def test_torchruns_own_report_is_not() -> None:
    assert not rank_traceback(TORCHRUN_REPORT)
    assert not rank_traceback("pretrain_gpt.py: error: rank 1 is gone (...)\n" + TORCHRUN_REPORT)


def test_an_error_line_is_found_behind_the_prefix() -> None:
    line = "[rank1]: pretrain_gpt.py: error: --save x is a file, not a directory"
    assert ERROR_LINE.match(RANK_PREFIX.sub("", line)) and not ERROR_LINE.match(line)
