"""Entry point of every Glassbox child process: ``python -m engine.utils.process_entry ROLE``.

The whole start-up is the process harness's (``engine.utils.process_harness.main``); this
module only runs it, so the harness's module state is the one its targets import (a module
run with ``-m`` is ``__main__``, a second copy). Kept tiny so a child starts fast: torch is
imported by the target, not here.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from engine.utils.process_harness import main

    sys.exit(main())
