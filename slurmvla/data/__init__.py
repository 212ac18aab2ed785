"""Data layer: LeRobot-format readers, the DROID dataset, the sample-data writer. Imports only the layers below it
(the configuration's schemas, not its composition, and the foundation; docs/architecture.md)."""

from slurmvla.errors import Failure


class DataError(ValueError, Failure):
    """A dataset file that cannot be read as its metadata says (missing, truncated, not parquet / video): the
    user's data, not a bug. The message names the file. Found while reading (start-up opens no video), so
    possibly in a dataloader worker: torch re-raises it in the trainer as a DataError whose message is the
    worker's traceback; :meth:`line` gives the one line back. ``path``: the file to blame, where there is one
    (data.on_damaged names it)."""

    def __init__(self, message: str = "", path: object = None):
        super().__init__(message)
        self.path = None if path is None else str(path)

    def __reduce__(self):
        return type(self), (str(self), self.path)

    def line(self) -> str:
        text = str(self).strip()
        if "Original Traceback" in text:  # raised in a dataloader worker: its last line is "...DataError: <message>"
            last = text.splitlines()[-1]
            return last.split("DataError: ", 1)[-1]
        return text
