"""`python -m shardwise.cli ...` is `shardwise ...` (how workers and tests start a command)."""

import sys

from shardwise.cli import main

sys.exit(main())
