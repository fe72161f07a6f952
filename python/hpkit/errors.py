"""Errors a user can act on: the CLI prints them as one line, never as a traceback."""


class HpkitError(Exception):
    """A problem the user can fix; str() is the whole message."""


class SpecError(HpkitError):
    """A job spec that cannot be run as written."""


class SlurmError(HpkitError):
    """Slurm refused a request or could not be reached."""
