"""The errors Canzona raises for what a user can fix: one line each, naming the fix.

One small module that ``integration`` (flags, the optimizer) and ``checkpoints`` (saves and
loads) both import, so neither folder imports the other for them.
"""

from __future__ import annotations


class CanzonaArgumentError(ValueError):
    """A bad combination of flags; the message is one line and names the fix."""


class CanzonaCheckpointError(CanzonaArgumentError):
    """A checkpoint that cannot be loaded; the message is one line naming the file and why."""


class CanzonaRankError(CanzonaArgumentError):
    """A failure one rank finds alone (a data file that changed under the job): that rank says it,
    once per job, where a flag error is said by the first rank only (every rank finds it alike)."""
