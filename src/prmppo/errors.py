"""The one exception family for refusals: bad config, bad input files, failed launch gates.

`python -m prmppo` prints a `PrmppoError` as a one-line reason and exits with code 2, so a bad
launch is told apart from a crash (1) and from success (0).
"""


class PrmppoError(Exception):
    """A refusal with a sentence that names what is wrong and what would be valid."""


EXIT_REFUSED = 2
