"""The exception family for refusals (bad config, bad input files, failed launch gates), and the stop signal.

`python -m prmppo` prints a `PrmppoError` as a one-line reason and exits with code 2, so a bad
launch is told apart from a crash (1) and from success (0). A coordinated stop (SIGTERM or
`max_wall_seconds`) saves a resumable checkpoint and raises `StopRequested`, which exits with
code 3: relaunch the same command with the same run dir to continue.
"""


class PrmppoError(Exception):
    """A refusal with a sentence that names what is wrong and what would be valid."""


class ConfigError(PrmppoError):
    """A config that cannot run; the message lists every problem found."""


class StopRequested(Exception):
    """A coordinated stop finished cleanly: a checkpoint is saved and the run can be resumed.

    `reason` is "sigterm" or "max_wall_seconds"; `checkpoint` the directory saved.
    """

    def __init__(self, reason: str, checkpoint: str):
        super().__init__(f"stopped by {reason} after saving {checkpoint}; relaunch the same command with the "
                         "same run dir (hydra.run.dir=...) to resume")
        self.reason, self.checkpoint = reason, checkpoint


EXIT_REFUSED = 2
EXIT_STOPPED = 3


class DataError(PrmppoError, ValueError):
    """A data file or row that cannot be used; the message names the file (and line)."""


class DataFileMissing(PrmppoError, FileNotFoundError):
    """A configured data file does not exist; the message names the path and the config key."""
