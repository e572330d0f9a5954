"""The one error a checkpoint raises for anything wrong with what is on disk or asked for."""


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded as asked. The message is one line naming the path,
    what was found and what was expected."""
