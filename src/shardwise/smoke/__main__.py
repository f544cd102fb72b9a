"""`python -m shardwise.smoke`: the GPU smoke test's command line (shardwise/smoke/__init__.py)."""

import sys

from shardwise.smoke import main

sys.exit(main())
