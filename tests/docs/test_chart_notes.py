"""The chart's NOTES.txt works as printed: it names the namespace runs go into (one the
operator watches), how to build the image the chart's defaults name, and how to watch a run;
the files it names exist in the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.operator.test_auth import helm_binary

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kubestar"


def render_notes(tmp_path: Path, *sets: str) -> str:
    """NOTES.txt as `helm install` prints it. `helm template` leaves NOTES.txt out, so a copy
    of the chart renders it through a template of its own."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "notes.txt")
    (chart / "templates" / "notes.yaml").write_text(
        'notes: |\n{{ tpl (.Files.Get "notes.txt") . | indent 2 }}\n'
    )
    args = [helm_binary(tmp_path), "template", "kubestar", str(chart), "-n", "kubestar-system"]
    args += ["--show-only", "templates/notes.yaml"]
    for value in sets:
        args += ["--set", value]
    env = {**os.environ, "HELM_CACHE_HOME": str(tmp_path), "HELM_CONFIG_HOME": str(tmp_path)}
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, check=True)
    notes: str = yaml.safe_load(done.stdout)["notes"]
    return notes


def test_notes_send_runs_to_a_watched_namespace_and_watch_them(tmp_path: Path) -> None:
    notes = render_notes(tmp_path, "operator.watchNamespaces={team-a,team-b}")
    assert "The operator watches team-a, team-b" in notes
    assert "kubectl apply -n team-a -f examples/tiny-cpu.yaml" in notes
    assert "kubectl get trainingrun -w -n team-a" in notes
    assert "kubectl describe trainingrun tiny-cpu -n team-a" in notes
    assert "kubectl logs deploy/kubestar-operator -n kubestar-system" in notes
    # Without a list, the release's own namespace is the one watched.
    assert "kubectl get trainingrun -w -n kubestar-system" in render_notes(tmp_path / "own")


def test_notes_build_the_images_the_chart_names(tmp_path: Path) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    notes = render_notes(tmp_path)
    build = f"images/build.sh cpu -t kubestar:{app_version} -t {values['images']['engineCpu']}"
    assert build in notes
    assert (REPO / "images" / "build.sh").exists() and (REPO / "images/cpu/Dockerfile").exists()
    custom = render_notes(
        tmp_path / "custom",
        "images.kubestar.repository=registry.local/kubestar",
        "images.kubestar.tag=dev",
        "images.engineCpu=registry.local/kubestar:dev",
    )
    assert "cpu -t registry.local/kubestar:dev -t registry.local/kubestar:dev" in custom


def test_the_run_the_notes_name_is_in_the_example() -> None:
    docs = list(yaml.safe_load_all((REPO / "examples" / "tiny-cpu.yaml").read_text()))
    runs = [doc["metadata"]["name"] for doc in docs if doc["kind"] == "TrainingRun"]
    assert runs == ["tiny-cpu"]


def test_notes_say_where_the_trained_model_lies(tmp_path: Path) -> None:
    own_claim = render_notes(tmp_path)
    assert "deletes with it. Copy it out first" in own_claim
    shared = render_notes(tmp_path / "shared", "trainer.sharedCheckpoints.pvcClaimName=ckpt")
    assert "on the shared checkpoint volume, kept when the run is deleted" in shared
    section = '"Taking the trained model out"'
    assert section in own_claim
    assert f"## {section.strip(chr(34))}" in (REPO / "docs" / "operator.md").read_text()
