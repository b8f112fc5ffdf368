"""`python -m trillium.cli`: the same as the `trillium` command."""

from . import app

app()
