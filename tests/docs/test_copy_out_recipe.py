"""docs/operator.md's recipe for taking the trained model out of a run's claim names what the
operator and the trainer really use: the claim's name, the path the trainer mounts it at,
the trainer's uid, the chart's image and the checkpoint's weights folder."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from kubestar.api.v1alpha1 import TrainingRunSpec
from kubestar.operator.build_trainer import checkpoint_claim, checkpoint_dir
from kubestar.operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Taking the trained model out"


def section() -> str:
    text = (REPO / "docs" / "operator.md").read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return text[start:end]


def copy_pod() -> dict[str, Any]:
    (block,) = re.findall(r"```yaml\n(.*?)```", section(), flags=re.DOTALL)
    pod: dict[str, Any] = yaml.safe_load(block)
    return pod


def tiny_run() -> dict[str, Any]:
    for document in yaml.safe_load_all((REPO / "examples" / "tiny-cpu.yaml").read_text()):
        if document["kind"] == "TrainingRun":
            return {
                **document,
                "metadata": {**document["metadata"], "namespace": "team-a", "uid": "u"},
            }
    raise AssertionError("examples/tiny-cpu.yaml has no TrainingRun")


def test_the_copy_pod_mounts_the_runs_claim_where_the_trainer_does() -> None:
    run, settings = tiny_run(), OperatorSettings()
    spec = TrainingRunSpec.model_validate(run["spec"])
    pod = copy_pod()["spec"]
    (volume,) = pod["volumes"]
    claim = checkpoint_claim(run, spec, settings)
    assert claim is not None
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (container,) = pod["containers"]
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == checkpoint_dir(run, spec, settings) and mount["readOnly"]


def test_the_copy_pod_runs_as_the_trainer_with_the_charts_image() -> None:
    chart = REPO / "helm" / "kubestar"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    app_version = yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"]
    pod = copy_pod()["spec"]
    uid = values["trainer"]["runAsUser"]
    assert pod["securityContext"]["runAsUser"] == uid == OperatorSettings().trainer.run_as_user
    assert values["trainer"]["checkpointDir"] == OperatorSettings().trainer.checkpoint_dir
    (container,) = pod["containers"]
    assert container["image"] == f"{values['images']['kubestar']['repository']}:{app_version}"
    # The restricted Pod Security Standard, which a tenant's namespace may enforce.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def test_the_copied_folder_is_the_checkpoints_weights() -> None:
    text = section()
    pod = copy_pod()
    name, mount = pod["metadata"]["name"], pod["spec"]["containers"][0]["volumeMounts"][0]
    copy = re.search(rf"kubectl cp team-a/{name}:(\S+) ", text)
    assert copy is not None
    assert copy.group(1) == f"{mount['mountPath']}/step-000012/weights"
    # The folder the trainer writes (kubestar.training.checkpoint.WEIGHTS), named in the
    # module's own layout; read from the source, so that this test needs no torch.
    source = (REPO / "training/kubestar/training/checkpoint.py").read_text()
    assert 'WEIGHTS = "weights"' in source and 'PREFIX = "step-"' in source
