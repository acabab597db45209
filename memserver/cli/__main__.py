"""`python -m memserver.cli`: the same as the `memserver` command."""

import sys

from memserver.cli import main

sys.exit(main())
