"""`python -m exitplan`: the same CLI as the `exitplan` script (where no script is installed, e.g. the GPU proof's
source tree)."""

from exitplan.cli import app

app()
