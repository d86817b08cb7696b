"""Project-wide pieces that every layer may import: the settings registry (tollgate/envs.py)."""
