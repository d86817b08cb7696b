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
