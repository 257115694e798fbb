"""Stopping on request: SIGTERM (a node drain, an eviction, a preemption, Ctrl-C's cousin)
asks the trainer to stop without losing work. It finishes the step in progress, checkpoints
it and exits with EXIT_STOPPED; run again (or the Job's retry) and it resumes there.

Every rank takes part: at each step's end the ranks agree (the maximum over all of them)
whether any was asked, so a pod drained in a world of several stops the whole world at the
same step.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

log = logging.getLogger(__name__)

# 128 + SIGTERM, as a process killed by it would report.
EXIT_STOPPED = 128 + signal.SIGTERM


class FinalFailure(Exception):
    """A failure no retry of the trainer can fix (a full checkpoint volume, a stage left
    without problems): the trainer states `reason: message` as its termination message and
    exits with EXIT_FINAL_FAILURE, and the run fails instead of retrying."""

    reason: str


class TrainingStopped(Exception):
    """Raised out of a training session that stopped on request after a checkpoint."""

    def __init__(self, step: int, checkpoint: str) -> None:
        super().__init__(f"stopped on request after step {step}; checkpoint {checkpoint}")
        self.step = step
        self.checkpoint = checkpoint


class StopRequest:
    """Whether this process was asked to stop (SIGTERM, once `install`ed)."""

    def __init__(self) -> None:
        self.requested = False
        self.installed = False

    def install(self) -> StopRequest:
        """Take SIGTERM (from the main thread)."""
        signal.signal(signal.SIGTERM, self._handle)
        self.installed = True
        return self

    def reclaim(self) -> None:
        """Take SIGTERM back after a library took it (ray.init installs its own handler,
        which dumps a stack and exits)."""
        if self.installed:
            self.install()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            log.warning("SIGTERM: stopping after the step in progress, with a checkpoint")
        self.requested = True
