"""Everything that talks to Ray Serve: the model replica, the gateway ingress and its model registry,
the Ray backend, the shared semantic-cache deployment, the application builders, deploy / scale /
delete / status, GPU sampling and the node's converted-model cache. The HTTP layer (gateway/*.py)
never imports this package; it reaches models through the `ModelBackend` protocol."""
