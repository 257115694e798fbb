"""The installation's token on a cluster: the chart makes it (a Secret), the operator reads
it from its own mount, copies it beside each resource (a Secret the resource owns) and mounts
that read-only into every pod that serves or calls kubestar's services, with the servers'
`--auth-token-file` flag. Builders checked without a cluster; the chart with `helm template`."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubestar.api.v1alpha1 import RolloutFleetSpec, SandboxPoolSpec, TrainingRunSpec
from kubestar.common.auth import ENV_TOKEN_FILE, namespace_token
from kubestar.operator import build_fleet, build_sandbox, build_trainer
from kubestar.operator import objects as o
from kubestar.operator.settings import Auth, OperatorSettings

from e2e.local_cluster import LocalCluster, OperatorProcess, apis, core, kubestar, wait_for
from tests.operator.support import CHART, parent
from tests.operator.test_reconcile import example, owned_by
from tests.real_parts import missing

TOKEN = "kubestar-test-token-0123456789abcdef"
RUN_SPEC = TrainingRunSpec.model_validate(
    {
        "rolloutFleetRef": {"name": "fleet"},
        "sandboxPoolRef": {"name": "pool"},
        "stages": [
            {
                "name": "s",
                "steps": 1,
                "maxResponseTokens": 64,
                "dataset": {"generator": "basic_arithmetic"},
            }
        ],
    }
)


def with_token(token: str = TOKEN) -> OperatorSettings:
    return OperatorSettings(
        auth=Auth(token_file="/var/run/secrets/kubestar/auth/token", token=token)
    )


def pod_of(workload: dict[str, Any]) -> dict[str, Any]:
    return dict(workload["spec"]["template"]["spec"])


def assert_mounted(workload: dict[str, Any], secret: str, flagged: bool) -> None:
    """The Secret mounted read-only in every container, the file named in the environment,
    the servers' flag, and the token's digest (not the token) on the pod template."""
    pod = pod_of(workload)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[o.AUTH_VOLUME] == {"name": o.AUTH_VOLUME, "secret": {"secretName": secret}}
    for container in pod["containers"]:
        mount = {"name": o.AUTH_VOLUME, "mountPath": o.AUTH_DIR, "readOnly": True}
        assert mount in container["volumeMounts"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env[ENV_TOKEN_FILE] == "/var/run/secrets/kubestar/auth/token"
        command = container["command"]
        if flagged:
            at = command.index("--auth-token-file")
            assert command[at + 1] == "/var/run/secrets/kubestar/auth/token"
        else:
            assert "--auth-token-file" not in command
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert len(annotations[o.ANNOTATION_AUTH]) == 16
    assert TOKEN not in json.dumps(workload)
    assert workload["metadata"]["annotations"][o.ANNOTATION_HASH] == o.spec_hash(workload)


def assert_secret(secret: dict[str, Any], name: str, owner: str) -> None:
    """The namespace's own token (parent() makes resources in "team"), not the chart's."""
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == name
    held = base64.b64decode(secret["data"]["token"]).decode()
    assert held == namespace_token(TOKEN, "team") and TOKEN not in held
    (reference,) = secret["metadata"]["ownerReferences"]
    assert reference["name"] == owner and reference["controller"] is True
    assert secret["metadata"]["labels"][o.LABEL_MANAGED_BY] == o.MANAGED_BY


def by_kind(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in children}


def test_a_pool_copies_the_token_and_both_planes_mount_it() -> None:
    pool = parent("SandboxPool", "pool")
    children = by_kind(build_sandbox.children(pool, SandboxPoolSpec(), with_token()))
    assert_secret(children["Secret/pool-sandbox-auth"], "pool-sandbox-auth", "pool")
    assert_mounted(children["StatefulSet/pool-sandbox-worker"], "pool-sandbox-auth", True)
    assert_mounted(children["Deployment/pool-sandbox"], "pool-sandbox-auth", True)
    # The Secret is made before the pods that mount it.
    kinds = [c.split("/")[0] for c in children]
    assert kinds.index("Secret") < kinds.index("StatefulSet")


def test_a_cpu_fleet_passes_the_flag_to_engine_and_scheduler() -> None:
    fleet = parent("RolloutFleet", "fleet")
    spec = RolloutFleetSpec.model_validate({"engine": {"extraArgs": ["--disable-log-stats"]}})
    children = by_kind(build_fleet.children(fleet, spec, with_token()))
    assert_secret(children["Secret/fleet-fleet-auth"], "fleet-fleet-auth", "fleet")
    assert "ConfigMap/fleet-engine-modules" not in children  # kubestar's engine image has them
    engines = children["Deployment/fleet-engine"]
    assert_mounted(engines, "fleet-fleet-auth", flagged=True)
    command = pod_of(engines)["containers"][0]["command"]
    # Before `--`: the flag is kubestar engine serve's, not vLLM's.
    at = command.index("--auth-token-file")
    assert command[at + 1] == o.AUTH_TOKEN_FILE
    assert at < command.index("--") < command.index("--disable-log-stats")
    assert_mounted(children["Deployment/fleet-scheduler"], "fleet-fleet-auth", True)


@pytest.mark.parametrize("accelerator", ["nvidia", "amd"])
def test_gpu_engines_load_copies_of_the_middleware_and_the_weights_route(accelerator: str) -> None:
    fleet = parent("RolloutFleet", "fleet")
    spec = RolloutFleetSpec.model_validate({"accelerator": accelerator})
    children = by_kind(build_fleet.children(fleet, spec, with_token()))
    engines = children["Deployment/fleet-engine"]
    assert_mounted(engines, "fleet-fleet-auth", flagged=False)
    (container,) = pod_of(engines)["containers"]
    command = container["command"]
    command = command[command.index("--") + 1 :]  # after the check of the engine's GPUs
    assert command[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    middleware = [command[i + 1] for i, arg in enumerate(command) if arg == "--middleware"]
    # The token is checked first: vLLM makes the last middleware the outermost.
    assert middleware == [
        "kubestar_weight_sync.WeightRoutes",
        "kubestar_engine_auth.BearerTokenMiddleware",
    ]
    extension = command[command.index("--worker-extension-cls") + 1]
    assert extension == "kubestar_weight_sync.WeightSyncExtension"
    env = {e["name"]: e["value"] for e in container["env"]}
    # The modules' folder is appended to the image's PYTHONPATH by the GPU check.
    assert "PYTHONPATH" not in env
    check = container["command"][: container["command"].index("--")]
    assert check[check.index("--python-path") + 1] == build_fleet.ENGINE_MODULES_DIR
    assert "VLLM_SERVER_DEV_MODE" not in env
    mount = {
        "name": "engine-modules",
        "mountPath": build_fleet.ENGINE_MODULES_DIR,
        "readOnly": True,
    }
    assert mount in container["volumeMounts"]
    config = children["ConfigMap/fleet-engine-modules"]
    volume = {"name": "engine-modules", "configMap": {"name": "fleet-engine-modules"}}
    assert volume in pod_of(engines)["volumes"]
    assert sorted(config["data"]) == [
        "kubestar_accelerators.py",
        "kubestar_engine_auth.py",
        "kubestar_weight_sync.py",
    ]
    assert "class BearerTokenMiddleware" in config["data"]["kubestar_engine_auth.py"]
    assert "class WeightSyncExtension" in config["data"]["kubestar_weight_sync.py"]


def test_the_engine_module_copies_import_with_the_standard_library_alone(tmp_path: Path) -> None:
    """What a vLLM image without kubestar does with the ConfigMap's module."""
    config = build_fleet.engine_modules_config(parent("RolloutFleet", "fleet"))
    for filename, source in config["data"].items():
        (tmp_path / filename).write_text(source)
    (tmp_path / "token").write_text(TOKEN)
    # The weights module imports torch where it is used, not to be imported.
    probe = (
        "import kubestar_accelerators, kubestar_engine_auth as m, kubestar_weight_sync as w; "
        "m.BearerTokenMiddleware(lambda *a: None); w.WeightRoutes(lambda *a: None)"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", probe],  # -S: no site-packages, so no kubestar
        env={"PYTHONPATH": str(tmp_path), ENV_TOKEN_FILE: str(tmp_path / "token")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def test_trainer_pods_mount_the_runs_copy() -> None:
    run = parent("TrainingRun", "run")
    settings = with_token()
    (secret,) = build_trainer.auth(run, settings)
    assert_secret(secret, "run-trainer-auth", "run")
    job = build_trainer.job(run, RUN_SPEC, RolloutFleetSpec(), SandboxPoolSpec(), settings)
    # The trainer is a client: the file in its environment, no server flag.
    assert_mounted(job, "run-trainer-auth", flagged=False)


def test_without_a_token_nothing_changes() -> None:
    settings = OperatorSettings()
    pool = build_sandbox.children(parent("SandboxPool", "pool"), SandboxPoolSpec(), settings)
    fleet = build_fleet.children(
        parent("RolloutFleet", "fleet"),
        RolloutFleetSpec.model_validate({"accelerator": "nvidia"}),
        settings,
    )
    run = parent("TrainingRun", "run")
    job = build_trainer.job(run, RUN_SPEC, RolloutFleetSpec(), SandboxPoolSpec(), settings)
    everything = json.dumps([*pool, *fleet, job])
    for word in (
        "Secret",
        o.AUTH_VOLUME,
        "--auth-token-file",
        ENV_TOKEN_FILE,
        "kubestar_engine_auth.",
    ):
        assert word not in everything
    assert build_trainer.auth(run, settings) == []


def test_a_new_token_rolls_the_pods() -> None:
    pool = parent("SandboxPool", "pool")
    first = build_sandbox.dispatcher_deployment(pool, SandboxPoolSpec(), with_token())
    second = build_sandbox.dispatcher_deployment(pool, SandboxPoolSpec(), with_token("other-token"))
    assert o.spec_hash(first) != o.spec_hash(second)
    digest = o.ANNOTATION_AUTH
    assert (
        first["spec"]["template"]["metadata"]["annotations"][digest]
        != second["spec"]["template"]["metadata"]["annotations"][digest]
    )


def test_settings_read_the_token_from_the_file_they_name(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    config = tmp_path / "settings.yaml"
    config.write_text(yaml.safe_dump({"auth": {"tokenFile": str(token_file)}}))
    settings = OperatorSettings.load(config)
    assert settings.auth.token == TOKEN and settings.auth.enabled
    # Never written out, never shown.
    assert TOKEN not in json.dumps(settings.model_dump(by_alias=True))
    assert TOKEN not in repr(settings)
    config.write_text(yaml.safe_dump({"auth": {"tokenFile": str(tmp_path / "absent")}}))
    with pytest.raises(Exception, match="cannot read the auth token file"):
        OperatorSettings.load(config)


def helm_binary(tmp_path: Path) -> str:
    found = shutil.which("helm")
    if found:
        return found
    candidate = LocalCluster(tmp_path).bin / "helm"
    if candidate.exists() and os.access(candidate, os.X_OK):
        return str(candidate)
    missing("no helm binary (e2e/local/install.sh fetches one)")


def render(tmp_path: Path, *sets: str) -> list[dict[str, Any]]:
    args = [helm_binary(tmp_path), "template", "kubestar", str(CHART), "--namespace", "ks"]
    for value in sets:
        args += ["--set", value]
    env = {**os.environ, "HELM_CACHE_HOME": str(tmp_path), "HELM_CONFIG_HOME": str(tmp_path)}
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, check=True)
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_the_chart_makes_a_random_token_and_mounts_it_into_the_operator(tmp_path: Path) -> None:
    docs = render(tmp_path)
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert secret["metadata"] == {**secret["metadata"], "name": "kubestar-auth", "namespace": "ks"}
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 64 and token.isalnum()
    again = next(d for d in render(tmp_path) if d["kind"] == "Secret")
    assert again["data"]["token"] != secret["data"]["token"]  # random (lookup keeps it live)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert {"name": "auth", "secret": {"secretName": "kubestar-auth"}} in pod["volumes"]
    mount = {"name": "auth", "mountPath": "/var/run/secrets/kubestar/auth", "readOnly": True}
    assert mount in pod["containers"][0]["volumeMounts"]
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    settings = yaml.safe_load(config["data"]["settings.yaml"])
    assert settings["auth"] == {"tokenFile": "/var/run/secrets/kubestar/auth/token"}
    OperatorSettings.model_validate(settings)
    (role,) = [
        d for d in docs if d["kind"] == "Role" and d["metadata"]["name"].endswith("-operator")
    ]
    secrets = [rule for rule in role["rules"] if "secrets" in rule["resources"]]
    assert secrets == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "patch"]}
    ]


def test_the_chart_can_use_an_existing_secret(tmp_path: Path) -> None:
    docs = render(tmp_path, "auth.existingSecret=my-token")
    assert not [d for d in docs if d["kind"] == "Secret"]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "auth", "secret": {"secretName": "my-token"}} in volumes


def test_the_operator_gives_a_pool_its_namespaces_token(
    cluster: LocalCluster, operator: OperatorProcess, auth_token: str, namespace: str
) -> None:
    """Against a real API server, with the chart's RBAC: the pool's Secret holds its
    namespace's token (derived from the chart's), owned by the pool and mounted by its pods;
    made again when deleted."""
    api = cluster.api()
    pool = api.create(kubestar(namespace, "sandboxpools"), example("SandboxPool"))
    name = pool["metadata"]["name"]
    path = core(namespace, "secrets", f"{name}-sandbox-auth")
    secret = wait_for("the pool's Secret", partial(api.get, path), timeout=20)
    assert owned_by(secret, pool)
    held = base64.b64decode(secret["data"]["token"]).decode()
    assert held == namespace_token(auth_token, namespace) != auth_token
    workers = wait_for(
        "the workers",
        partial(api.get, apis("apps/v1", namespace, "statefulsets", f"{name}-sandbox-worker")),
        timeout=20,
    )
    volumes = {v["name"]: v for v in workers["spec"]["template"]["spec"]["volumes"]}
    assert volumes[o.AUTH_VOLUME]["secret"]["secretName"] == f"{name}-sandbox-auth"
    api.delete(path)
    again = wait_for("the Secret made again", partial(api.get, path), timeout=30)
    assert again["metadata"]["uid"] != secret["metadata"]["uid"]


def test_each_namespace_gets_a_token_of_its_own() -> None:
    """Derived from the installation's (an HMAC of the namespace): the same for every
    resource of a namespace, another in every other namespace, and the installation's token
    is not to be had back from it."""
    settings = with_token()

    def held(namespace: str, kind: str = "SandboxPool") -> str:
        pool = parent(kind, "p", namespace=namespace)
        children = (
            build_sandbox.children(pool, SandboxPoolSpec(), settings)
            if kind == "SandboxPool"
            else build_trainer.auth(pool, settings)
        )
        (secret,) = [c for c in children if c["kind"] == "Secret"]
        return base64.b64decode(secret["data"]["token"]).decode()

    assert held("team-a") == held("team-a", "TrainingRun") == namespace_token(TOKEN, "team-a")
    assert held("team-a") != held("team-b")
    assert len(held("team-a")) == 64 and TOKEN not in held("team-a")
