"""Where a training run's services answer: the rollout scheduler and the sandbox (gRPC), and
how the fleet's engines get new weights.

On one machine the local launcher (`kubestar.training.local`) starts them and says where; in a
cluster the operator does, through the trainer's environment (`kubestar.api.trainer_contract`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kubestar.engine.weight_sync import local_address


@dataclass
class Endpoints:
    scheduler: str
    sandbox: str
    # The fleet's spec.weightSync: "broadcast" from rank 0's WeightServer, which listens on
    # `weights_listen` (HOST:PORT, the address the engines reach it at; port 0: any free
    # one), or "volume": the engines read the folder the trainer writes.
    weight_sync: str = "broadcast"
    weights_listen: str = "127.0.0.1:0"

    def weight_server_address(self) -> tuple[str, int]:
        """(host, port) for rank 0's WeightServer: `weights_listen`, an empty host being this
        machine's address on the route to the scheduler (a pod's own address)."""
        host, _, port = self.weights_listen.rpartition(":")
        if not host:
            scheduler_host, _, scheduler_port = self.scheduler.rpartition(":")
            host = local_address(scheduler_host.strip("[]"), int(scheduler_port))
        return host, int(port or 0)
