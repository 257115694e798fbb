"""The kubestar operator (kopf): reconciles SandboxPools, RolloutFleets and TrainingRuns.

Modules: `settings` (what the chart configures), `objects` (names, labels, owner references),
`build_sandbox`, `build_fleet`, `build_trainer` (pure builders of child objects), `conditions`
(pod diagnosis and conditions), `kube` (a small async API client), `reconciler` (apply,
status, events, the work queue), one module per resource (`sandboxpool`, `rolloutfleet`,
`trainingrun`), `leader` (Lease leader election), `metrics`, `contract` (what the trainer
pod receives and how it reports), `main` (kopf wiring and `kubestar operator run`).
"""
