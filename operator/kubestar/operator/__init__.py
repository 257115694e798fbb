"""The kubestar operator (kopf): reconciles SandboxPools, RolloutFleets and TrainingRuns.

Modules: `settings` (what the chart configures), `objects` (names, labels, owner references),
`build_sandbox`, `build_fleet`, `build_trainer` (pure builders of child objects), `conditions`
(pod diagnosis and conditions), `reconciler` (apply, status, events, the work queue), one
module per resource (`sandboxpool`, `rolloutfleet`, `trainingrun`), `leader` (Lease leader
election), `metrics`, `main` (kopf wiring and `kubestar operator run`).

Beside kopf's watches it talks to the API server with kubestar's one client,
kubestar.common.kube. What the trainer pod receives and how it reports is the trainer
contract, kubestar.api.trainer_contract, shared with the trainer.
"""
