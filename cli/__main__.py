"""`python -m cli ...`: the `posttrain` command line."""

import sys

from cli.main import main

sys.exit(main())
