"""``python -m mixprec``: the same as the ``mixprec`` command."""

import sys

from mixprec.app.cli.main import main

sys.exit(main())
