"""What the scheduler raises when a turn or a request cannot be served (the gRPC server maps
each to a status code: kubestar.scheduler.server)."""

from __future__ import annotations


class SchedulerError(RuntimeError):
    """A turn or a request to the scheduler could not be served."""


class NoEngineAvailable(SchedulerError):
    """No engine is left to run the turn (all failed or were removed)."""


class TurnRejected(SchedulerError):
    """The turn is invalid, or an engine refused it (HTTP 4xx): retrying would not help."""


class SchedulerDraining(SchedulerError):
    """The scheduler is shutting down and takes no new turns."""


class UnknownEngine(SchedulerError, KeyError):
    """No engine has that name."""
