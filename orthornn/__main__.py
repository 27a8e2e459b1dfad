"""``python -m orthornn``: the console script."""

from orthornn.cli import main

raise SystemExit(main())
