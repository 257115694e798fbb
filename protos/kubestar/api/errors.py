"""The base of kubestar's own errors whose message already says what failed, where, and what
to do: the CLI prints such a message as it is, on one line."""

from __future__ import annotations


class KubestarError(Exception):
    """An error a person can act on from its message alone."""
