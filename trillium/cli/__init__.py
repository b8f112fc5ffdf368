"""The `trillium` command line (`app`): its commands live by topic in this package's modules,
each registering with the one Typer app of `app.py`.

Imports run one way: `app` <- `local`, `training`, `jobs`, `streams`, `serving` <- this front.
"""

# Each module registers its commands on import; this order is `trillium --help`'s.
from . import local, training, jobs, streams, serving  # noqa: F401  # isort: skip
from .app import app
from .training import run_job, summarize

__all__ = ["app", "run_job", "summarize"]
