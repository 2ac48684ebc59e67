"""The one base class of the errors tbexp reports to a user: bad input, not a bug.

`python -m tbexp` catches `TbexpError`, prints its message on one line and exits 2, so every error that
names a file or a config key reaches the user the same way, whichever module raised it. Each subclass also
keeps the builtin base it had (ValueError for bad values, RuntimeError for things that failed), so code that
catches those still does. A bug is anything else, and keeps its traceback.
"""


class TbexpError(Exception):
    """Bad input or a missing service, explained in the message (which names the file or key)."""
