"""User-facing errors: one line naming what was wrong and how to fix it, never a traceback."""


class UserError(Exception):
    """Bad input (config, files, prompts). The entry points print it on one line and exit 2."""
