"""``python -m stepfuse``: the ``stepfuse`` command."""

import sys

from .cli import main

sys.exit(main())
