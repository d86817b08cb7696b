"""Deploying models from several threads at once (ops.deploy_model is a plain Python call): Serve's options() pickles
the autoscaling policy through cloudpickle's process-wide register / unregister by value, which raced into
"... is not registered for pickle by value" before model_application held a lock around it."""

import sys
from concurrent.futures import ThreadPoolExecutor

from gateway.serving.model_app import model_application
from gateway.settings import Settings
from tests.gateway.serve_platform import test_spec


def test_applications_built_from_eight_threads_at_once_all_build() -> None:
    settings = Settings()
    specs = [test_spec(f"threaded-{i}") for i in range(8)]
    switch = sys.getswitchinterval()
    # threads interleave inside options(): without the lock, dozens of the 320 builds failed
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(len(specs)) as pool:
            built = list(pool.map(lambda spec: [model_application(spec, settings) for _ in range(40)], specs))
    finally:
        sys.setswitchinterval(switch)
    assert [len(b) for b in built] == [40] * len(specs)
