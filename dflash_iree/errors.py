"""The one exception type users see: a message that names the file or field and the fix.

The CLI prints `DFlashError` messages without a traceback and exits with status 2;
anything else is a bug and keeps its traceback.
"""


class DFlashError(Exception):
    """Bad input: a wrong or mismatched checkpoint, a missing artifact, an out-of-range option.

    The message alone must tell the user what is wrong and how to fix it.
    """
