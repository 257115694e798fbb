"""The scoring service: the process preference model (PPM) served over gRPC for search.

* `kubestar.scoring.model`: the PPM itself (its folder, loading, scoring); training it is
  `kubestar.search.ppm`'s.
* `kubestar.scoring.batcher`: gathers the sequences of concurrent requests into batches.
* `kubestar.scoring.metrics`: its Prometheus metrics.
* `kubestar.scoring.server`: the gRPC server (`kubestar ppm serve`): ScoringService, health,
  metrics, the installation's token, drain.
* `kubestar.scoring.client`: `ScoringClient`, the async client. (The search's `Scorer`
  backed by the service is `kubestar.search.scorer.PpmScorer`.)
"""
