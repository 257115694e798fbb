"""The KV-aware rollout scheduler between the agent loop and the vLLM engines.

* `kubestar.scheduler.core`: the pure core (engine state, /metrics parsing, policies).
* `kubestar.scheduler.scheduler`: the async scheduler: the queue of turns, admission,
  segments and moves.
* `kubestar.scheduler.records`: a turn and an engine, as the modules below share them.
* `kubestar.scheduler.engines`: the engines' health (scrapes, failures, probes) and prefix
  affinity.
* `kubestar.scheduler.weights`: weight updates pushed to every engine.
* `kubestar.scheduler.proto`: the scheduler's answers as rollout.proto messages.
* `kubestar.scheduler.config`, `kubestar.scheduler.errors`: its settings and errors.
* `kubestar.scheduler.server`: the gRPC server (`kubestar scheduler serve`).
* `kubestar.scheduler.client`: `SchedulerClient`, the async client.
* `kubestar.scheduler.discovery`: engines found as ready pods in Kubernetes.
* `kubestar.scheduler.simulator`: the same policies on a simulated fleet (capacity
  projections; `bench/rollout_sim.py`).
"""
