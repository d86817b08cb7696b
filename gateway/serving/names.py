"""Names of Tollgate's Ray Serve applications and deployments, shared by what deploys them and what reads
their status."""

GATEWAY_APP = "tollgate"
MODEL_APP_PREFIX = "model-"
MODEL_DEPLOYMENT = "ModelServer"


def model_app_name(model: str) -> str:
    return MODEL_APP_PREFIX + model


def model_of_app(app_name: str) -> str | None:
    """The model an application serves, or None for an application that is not a model's."""
    return app_name[len(MODEL_APP_PREFIX):] if app_name.startswith(MODEL_APP_PREFIX) else None

# a resource only the head node has (Ray's own libraries pin their state actors with it): the gateway and its cache
# ask for a sliver of it, so they live on the node that outlives the workers. Spread onto a model's node (Serve's
# default), a gateway replica dies with it, and every request it was handling gets Serve's plain-text 500
HEAD_NODE_ONLY = {"node:__internal_head__": 0.001}
