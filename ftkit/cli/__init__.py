"""ftkit's command line: one small module per command; options declared once in :mod:`ftkit.cli.options`."""

__all__ = [
    "check",
    "doctor",
    "explain",
    "export",
    "import_",
    "init",
    "launch",
    "main",
    "options",
    "plan",
    "render",
    "report",
    "schema",
    "status",
    "stop",
    "submit",
]
