"""ftkit's command line: one small module per command; options declared once in :mod:`ftkit.cli.options`."""
