"""`python -m dcredit_opt`: see dcredit_opt.cli."""

import sys

from .cli import main

sys.exit(main())
