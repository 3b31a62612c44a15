"""``python -m tui``: engine-top."""

import sys

from tui.cli import main

sys.exit(main())
