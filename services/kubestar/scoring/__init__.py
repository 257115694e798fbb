"""The scoring service: the process preference model (PPM) served over gRPC for search.

* `kubestar.scoring.batcher`: gathers the sequences of concurrent requests into batches.
* `kubestar.scoring.metrics`: its Prometheus metrics.
* `kubestar.scoring.server`: the gRPC server (`kubestar ppm serve`): ScoringService, health,
  metrics, the installation's token, drain.
* `kubestar.scoring.client`: `ScoringClient`, the async client, and `PpmScorer`, the
  search's `Scorer` backed by the service.
"""
