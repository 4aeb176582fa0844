"""`python -m jshard ...`: the `jshard` command line."""

import sys

from jshard._cli import main

sys.exit(main())
