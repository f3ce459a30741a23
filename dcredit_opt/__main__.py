"""`python -m dcredit_opt`: see dcredit_opt.cli.commands."""

import sys

from .cli.commands import main

sys.exit(main())
