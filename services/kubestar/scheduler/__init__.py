"""The KV-aware rollout scheduler between the agent loop and the vLLM engines.

* `kubestar.scheduler.core`: the pure core (engine state, /metrics parsing, policies).
* `kubestar.scheduler.scheduler`: the async scheduler (queue, reservations, failures, weights).
* `kubestar.scheduler.server`: the gRPC server (`kubestar scheduler serve`).
* `kubestar.scheduler.client`: `SchedulerClient`, the async client.
"""
