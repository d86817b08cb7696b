"""Whether the Ray cluster as it is now has a node that could hold one replica of a model: asked at deploy time (a
warning) and when a request has waited out the cold-start bound (its 503 says what the cluster lacks)."""

from __future__ import annotations

from gateway.specs import ModelSpec


def node_shortfall(spec: ModelSpec) -> str | None:
    """Why no alive node of the cluster as it is now could hold one replica of `spec`; None when one can."""
    import ray

    need = {"GPU": spec.resources.num_gpus, "CPU": spec.resources.num_cpus, **spec.resources.custom}
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if any(all(node.get(k, 0.0) >= v for k, v in need.items() if v) for node in nodes):
        return None
    most = {k: max((node.get(k, 0.0) for node in nodes), default=0.0) for k in need}
    asked = [k for k, v in need.items() if v]
    return (f"no node of this cluster has what one replica needs ({_amounts(need, asked)}; the most any node has: "
            f"{_amounts(most, asked)})")


def _amounts(amounts: dict[str, float], names: list[str]) -> str:
    return ", ".join(f"{amounts[k]:g} {k}" for k in names)
