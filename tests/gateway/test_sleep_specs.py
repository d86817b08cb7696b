"""Spec fields for sharing a GPU and sleeping when idle: checked at deploy time, kept out of Ray's own config."""

from __future__ import annotations

import pytest

from gateway.specs import SpecError, parse_spec

BASE = {"name": "m", "source": "random:llama-tiny"}


def test_a_fraction_of_a_gpu_needs_a_memory_share_that_fits_in_it():
    with pytest.raises(SpecError, match=r"engine.gpu_memory_utilization: 0.9 is more than .*num_gpus: 0.5"):
        parse_spec({**BASE, "resources": {"num_gpus": 0.5}})
    spec = parse_spec({**BASE, "resources": {"num_gpus": 0.5}, "engine": {"gpu_memory_utilization": 0.45}})
    assert spec.resources.num_gpus == 0.5 and spec.engine["gpu_memory_utilization"] == 0.45


def test_sleep_after_s_is_the_replicas_setting_not_ray_serves():
    spec = parse_spec({**BASE, "autoscaling": {"sleep_after_s": 30, "downscale_delay_s": 600}})
    assert spec.autoscaling.sleep_after_s == 30
    assert "sleep_after_s" not in spec.autoscaling.serve_config()
    with pytest.raises(SpecError, match="autoscaling.sleep_after_s"):
        parse_spec({**BASE, "autoscaling": {"sleep_after_s": 0}})


def test_the_engine_sleep_settings_are_engine_fields_a_spec_may_set():
    spec = parse_spec({**BASE, "engine": {"wake_on_request": False, "sleep_wait_timeout_s": 5}})
    assert spec.engine["sleep_wait_timeout_s"] == 5
    with pytest.raises(SpecError, match="engine.sleep_wait_timeout_s"):
        parse_spec({**BASE, "engine": {"sleep_wait_timeout_s": -1}})


def test_custom_resources_pin_a_model_to_the_nodes_that_have_them():
    pytest.importorskip("ray")
    from gateway.serving.model_app import model_application
    from gateway.settings import Settings

    spec = parse_spec({**BASE, "resources": {"num_cpus": 0.5, "custom": {"node_b": 1}}})
    options = model_application(spec, Settings())._bound_deployment.ray_actor_options
    assert options == {"num_cpus": 0.5, "num_gpus": 0, "resources": {"node_b": 1.0}}
    assert "resources" not in model_application(parse_spec(BASE), Settings())._bound_deployment.ray_actor_options


def test_each_bad_custom_resource_is_named():
    bad = {"node_b": 0, "GPU": 1, "two words": 1, "half": 1.5, "nan": float("nan"), "flag": True}
    with pytest.raises(SpecError) as e:
        parse_spec({**BASE, "resources": {"custom": bad}})
    text = str(e.value)
    assert "resources.custom.node_b: the amount must be > 0" in text
    assert "resources.custom.GPU: a built-in Ray resource; use its own field (resources.num_gpus)" in text
    assert "resources.custom.'two words': a resource name is" in text
    assert "resources.custom.half: an amount over 1 must be a whole number" in text
    assert "resources.custom.nan: the amount must be a finite number" in text
    assert "resources.custom.flag: the amount must be a finite number" in text
    with pytest.raises(SpecError, match="resources.custom: Input should be a valid dictionary"):
        parse_spec({**BASE, "resources": {"custom": ["node_b"]}})


def test_a_sleep_that_would_come_after_the_replica_ends_is_refused_naming_both_delays():
    with pytest.raises(SpecError, match=r"autoscaling.sleep_after_s: 300 s is not less than downscale_delay_s \(300 s\)"):
        parse_spec({**BASE, "autoscaling": {"sleep_after_s": 300}})
    with pytest.raises(SpecError, match=r"not less than downscale_to_zero_delay_s \(60 s\)"):
        parse_spec({**BASE, "autoscaling": {"sleep_after_s": 90, "downscale_to_zero_delay_s": 60}})
    # a replica kept by min_replicas never ends: it may sleep whenever
    assert parse_spec({**BASE, "autoscaling": {"sleep_after_s": 900, "min_replicas": 1}}).autoscaling.sleep_after_s == 900


def test_more_than_one_gpu_is_a_whole_number_of_gpus():
    with pytest.raises(SpecError, match=r"resources.num_gpus: a share of more than one GPU must be a whole number"):
        parse_spec({**BASE, "resources": {"num_gpus": 1.5}})
    assert parse_spec({**BASE, "resources": {"num_gpus": 2}}).resources.num_gpus == 2
