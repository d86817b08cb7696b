"""Errors of the platform commands that the CLI reports without a traceback."""


class NoPlatform(RuntimeError):
    """No Ray cluster runs where the command looked for one."""
