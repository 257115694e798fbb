"""Where a training run's services answer: the rollout scheduler and the sandbox (gRPC).

On one machine the local launcher (`kubestar.training.local`) starts them and says where; in a
cluster the operator does, through the trainer's environment (`kubestar.api.trainer_contract`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Endpoints:
    scheduler: str
    sandbox: str
