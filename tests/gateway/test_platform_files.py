"""What an operator deploys (platform/): every file loads, its specs validate and its import paths resolve."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from billing.db import make_engine
from gateway.specs import load_spec, load_specs

ROOT = Path(__file__).resolve().parents[2]
PLATFORM = ROOT / "platform"
PROMTOOL = shutil.which("promtool")


def _resolve(import_path: str) -> object:
    module, _, attr = import_path.partition(":")
    return getattr(importlib.import_module(module), attr)


def test_model_specs_validate() -> None:
    specs = {s.name: s for s in load_specs(PLATFORM / "models").specs}
    assert {"smollm2-135m", "llama-3.1-8b", "all-minilm-l6-v2"} <= set(specs)
    small, large = specs["smollm2-135m"], specs["llama-3.1-8b"]
    assert small.tool_parser == "hermes" and large.tool_parser == "llama3_json"
    assert small.resources.num_gpus == 0 and small.size == "small"
    assert large.resources.num_gpus == 1 and large.size == "large" and large.autoscaling.min_replicas == 0
    embedder = specs["all-minilm-l6-v2"]
    assert embedder.kind == "embedding" and embedder.resources.num_gpus == 0 and not embedder.tasks


def test_rayservice_runs_the_same_applications(db_url: str) -> None:
    pytest.importorskip("ray")
    from billing.deployments import deployment
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    manifest = yaml.safe_load((PLATFORM / "kuberay" / "rayservice.yaml").read_text())
    assert manifest["kind"] == "RayService"
    config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)  # Ray's own check of a serve config file
    apps = {a["name"]: a for a in config["applications"]}
    from gateway.serving.names import GATEWAY_APP, model_app_name

    assert apps[GATEWAY_APP]["route_prefix"] == "/"
    assert all(a["route_prefix"] is None for n, a in apps.items() if n != GATEWAY_APP)
    for name, app in apps.items():
        builder = _resolve(app["import_path"])
        args = dict(app.get("args") or {})
        if "spec" in args:  # the image copies the repository to /app
            path = ROOT / Path(args["spec"]).relative_to("/app")
            spec = load_spec(path)
            assert name == model_app_name(spec.name)
            args["spec"] = str(path)
        assert callable(builder)
        application = builder({**args, "database_url": db_url})
        assert isinstance(application, Application)
        if "spec" in args:  # recorded as `platform deploy` records it: priced and routed by the gateway
            recorded = deployment(make_engine(db_url), spec.name)
            assert recorded is not None and recorded.spec == spec.model_dump(mode="json")
            options = application._bound_deployment.ray_actor_options
            assert options["num_gpus"] == spec.resources.num_gpus and options["num_cpus"] == spec.resources.num_cpus
    assert ROOT.joinpath("platform", "models").is_dir()


def test_ray_cluster_config() -> None:
    cluster = yaml.safe_load((PLATFORM / "ray" / "cluster.yaml").read_text())
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    assert any(t["resources"].get("GPU", 0) >= 1 and t.get("min_workers", 0) == 0 for t in types.values())
    assert cluster["docker"]["image"].startswith("tollgate")


def test_dockerfile_copies_real_paths_and_runs_a_real_command() -> None:
    text = (PLATFORM / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (?:--\S+ )*(\S+) ", text, flags=re.M):
        for part in src.split():
            assert list(ROOT.glob(part.rstrip("*") + "*")), f"COPY {part}: not in the repository"
    cmd = yaml.safe_load(re.search(r"^CMD (.+)$", text, flags=re.M).group(1))
    assert cmd[0] == "platform"
    from gateway.cli import parser

    args = parser().parse_args(cmd[1:])
    assert args.func.__name__ == "cmd_up"
    assert _resolve("gateway.cli:main")


def test_deploy_rejects_a_bad_spec_naming_each_field(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from gateway.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: m\nsource: x\nresources: {num_gpus: -1}\ntool_parser: mistral\n"
                   "autoscaling: {min_replicas: 3, max_replicas: 2, bogus: 1}\nengine: {max_model_lenn: 5}\n")
    assert main(["--home", str(tmp_path), "deploy", str(bad)]) == 2  # before any cluster is contacted
    err = capsys.readouterr().err
    for path in ("resources.num_gpus", "autoscaling.bogus", "engine.max_model_lenn"):
        assert f"  {path}: " in err
    assert "  tool_parser: unknown tool-call format 'mistral' (known: hermes, llama3_json)" in err
    bad.write_text("name: m\nsource: x\nautoscaling: {min_replicas: 3, max_replicas: 2}\n")
    assert main(["--home", str(tmp_path), "deploy", str(bad)]) == 2
    assert "autoscaling.max_replicas: must be >= min_replicas" in capsys.readouterr().err
    bad.write_text("- not\n- a mapping\n")
    assert main(["--home", str(tmp_path), "deploy", str(bad)]) == 2


def test_tensor_parallel_spec_needs_as_many_gpus_as_ranks() -> None:
    from gateway.specs import SpecError, parse_spec

    base = {"name": "m", "source": "random:llama-tiny", "engine": {"tensor_parallel_size": 2}}
    with pytest.raises(SpecError, match="engine.tensor_parallel_size: 2 ranks need 2 GPUs per replica"):
        parse_spec({**base, "resources": {"num_gpus": 1}})
    assert parse_spec({**base, "resources": {"num_gpus": 2}}).engine["tensor_parallel_size"] == 2
    assert parse_spec(base).resources.num_gpus == 0  # CPU replicas split over gloo processes


def _gateway_scrape_job() -> dict:
    config = yaml.safe_load((PLATFORM / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "tollgate-gateway"]
    return job


def test_prometheus_scrapes_the_gateway_metrics_with_an_admin_key() -> None:
    from gateway.routes import router
    from gateway.settings import Settings

    job = _gateway_scrape_job()
    assert job.get("scheme", "http") == "http" and job.get("metrics_path", "/metrics") == "/metrics"
    assert "/metrics" in {getattr(r, "path", None) for r in router.routes}
    # the tollgate_tenant_* series the budget alerts read need an admin key, from a file: none in the repository
    auth = job["authorization"]
    assert set(auth) == {"type", "credentials_file"} and auth["type"] == "Bearer"
    assert Path(auth["credentials_file"]).is_absolute()
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert targets == [f"127.0.0.1:{Settings().port}"]  # where `platform up` serves


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not on PATH (Debian: apt-get install prometheus)")
def test_promtool_checks_the_scrape_config(tmp_path: Path) -> None:
    key_file = tmp_path / "tollgate-admin-key"
    key_file.write_text("tga-not-a-real-key\n")
    text = (PLATFORM / "prometheus" / "prometheus.yml").read_text()
    credentials_file = _gateway_scrape_job()["authorization"]["credentials_file"]
    (tmp_path / "prometheus.yml").write_text(text.replace(credentials_file, str(key_file)))
    shutil.copy(PLATFORM / "prometheus" / "alerts.yml", tmp_path)  # promtool checks the rule files it names too
    done = subprocess.run([str(PROMTOOL), "check", "config", "prometheus.yml"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
