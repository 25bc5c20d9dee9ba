"""``python -m mixprec``: the same as the ``mixprec`` command."""

from mixprec.app.cli.main import console_main

console_main()
