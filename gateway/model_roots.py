"""Where a model spec may load weights and tokenizers from. A path in a spec must lie, after `~` and
symlinks are resolved, under one of the allowed roots:

- the directory holding the spec file (platform/models/ or TOLLGATE_MODELS_DIR);
- each directory in TOLLGATE_MODEL_ROOTS (separated by os.pathsep); unset, it is /models, the volume
  the bundled large-model spec mounts;
- the Hugging Face cache (HF_HOME, default ~/.cache/huggingface).

`pkg:<python.package>` and `random:<name>` are not paths and are always allowed (a package name must
be a dotted identifier). A relative path is taken relative to the spec file's directory and returned
absolute, so the engine reads the very file that was checked, whatever its working directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tollgate import envs

ROOTS_ENV = "TOLLGATE_MODEL_ROOTS"
SCHEMES = ("pkg:", "random:")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # file://, https://, s3://: not read as a relative path


def allowed_roots(spec_dir: Path) -> list[Path]:
    extra = [p for p in str(envs.get(ROOTS_ENV)).split(os.pathsep) if p]
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return [Path(os.path.realpath(p)) for p in (spec_dir, *extra, hf_home)]


def checked_source(field: str, value: str, spec_dir: Path) -> str:
    """`value` as the engine should get it; a ValueError naming `field` when it points outside the roots."""
    if value.startswith(SCHEMES):
        scheme, _, name = value.partition(":")
        if scheme == "pkg" and not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"{field}: pkg: needs a Python package name (dotted identifiers), got {name!r}")
        return value
    if "\x00" in value:
        raise ValueError(f"{field}: must not contain NUL characters")
    if _URL.match(value):
        raise ValueError(f"{field}: {value!r} is a URL; give a path under the allowed model roots, "
                         "pkg:<python.package> or random:<name>")
    path = Path(os.path.expanduser(value))
    resolved = Path(os.path.realpath(spec_dir / path))  # an absolute `path` replaces spec_dir
    roots = allowed_roots(spec_dir)
    if not any(resolved == root or root in resolved.parents for root in roots):
        raise ValueError(f"{field}: {value!r} resolves to {resolved}, outside the allowed model roots "
                         f"({', '.join(map(str, roots))}; add a directory with {ROOTS_ENV})")
    return str(resolved)
