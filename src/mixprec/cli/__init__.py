"""The ``mixprec`` command line."""
