"""docs/reference is generated from the code (kubestar.api.reference): the committed pages are
what the generator makes now, and they leave no field or value out."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from kubestar.api import crds, reference
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[2]


def test_committed_pages_equal_generated() -> None:
    stale = reference.stale_pages(REPO)
    assert not stale, f"{', '.join(map(str, stale))} stale: run `{reference.REGENERATE}`"


def test_every_field_of_the_three_kinds_is_in_the_api_page() -> None:
    page = reference.render_api_reference()

    def paths(model: type[BaseModel], prefix: str) -> list[str]:
        return [f"`{prefix}.{field.alias or name}`" for name, field in model.model_fields.items()]

    for kind in crds.KINDS:
        fields = paths(kind.spec, "spec") + paths(kind.status, "status")
        assert [path for path in fields if path not in page] == [], kind.kind
    # Fields that hand-written tables once left out.
    for path in (
        "spec.weightSync",
        "spec.scheduler.weightsReloadTimeoutSeconds",
        "spec.algorithm.updatesPerStep",
        "spec.algorithm.tisCap",
        "spec.algorithm.maxStaleness",
        "spec.trainer.rayAddress",
        "spec.evaluation.everySteps",
        "spec.evaluation.search.temperature",
        "spec.evaluation.search.seed",
        "spec.resilience.stallSeconds",
    ):
        assert f"| `{path}` |" in page, path


def test_every_row_has_a_type_and_a_description() -> None:
    pages = {
        "api": reference.render_api_reference(),
        "values": reference.render_values_reference(REPO / reference.CHART),
    }
    for name, page in pages.items():
        rows = [line for line in page.splitlines() if line.startswith("| `")]
        assert rows, name
        for row in rows:
            cells = [cell.strip() for cell in row.strip("|").split(" | ")]
            assert cells[1] and cells[-1], f"{name}: {row}"


def test_every_chart_value_is_in_the_values_page() -> None:
    values = yaml.safe_load((REPO / reference.CHART / "values.yaml").read_text())
    page = reference.render_values_reference(REPO / reference.CHART)
    for section, body in values.items():
        assert f"## {section}" in page
        for key in body:
            assert f"`{section}.{key}" in page, f"{section}.{key}"


def test_check_names_the_command_that_regenerates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(REPO / reference.CHART, tmp_path / reference.CHART)
    assert reference.main(["--write", "--root", str(tmp_path)]) == 0
    assert reference.main(["--check", "--root", str(tmp_path)]) == 0
    page = tmp_path / reference.VALUES_PAGE
    page.write_text(page.read_text().replace("IfNotPresent", "Always"))
    assert reference.main(["--check", "--root", str(tmp_path)]) == 1
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and reference.REGENERATE in error
