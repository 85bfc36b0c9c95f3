"""``python -m service.cli``: the same as the ``headcat`` script."""

from service.cli import app

app()
