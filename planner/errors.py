"""The one error type for bad input; the CLI turns it into one line on stderr and exit code 2."""


class InputError(ValueError):
    """Bad or unknown input: a file, a field, an id, a size or a limit. The message names what is wrong."""
