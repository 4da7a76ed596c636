"""User-facing errors: one line that names the problem and the fix."""


class TcalError(Exception):
    """Bad input or an unrecoverable condition the user can fix.

    The CLI prints ``str(err)`` on one line and exits with status 2, never a traceback.
    """


class TcalWarning(UserWarning):
    """Something the user should know that does not stop the work (the CLI prints it as one line)."""
