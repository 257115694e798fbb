"""The base of kubestar's own errors whose message already says what failed, where, and what
to do: the CLI prints such a message as it is, on one line."""

from __future__ import annotations


class KubestarError(Exception):
    """An error a person can act on from its message alone."""


class SettingError(KubestarError, ValueError):
    """A setting that cannot work; `setting` is its name in the settings object (`model`,
    `sft.base`, ...), for a command to name its own flag."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting
