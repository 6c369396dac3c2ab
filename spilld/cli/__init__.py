"""The ``spilld`` command line: the daemon (``spilld`` = ``spilld serve``) and its tools.

Every size and duration goes through one parser (``config.parse_size`` / ``parse_duration``), every refusal is
one line on stderr with exit 2, and no input ends in a traceback: errors map to the exit codes of ``EPILOG``.
``--socket`` and ``--dir`` are accepted before or after a command that takes them (refused by the others). One
module per group of commands; ``common`` holds what they share, ``parser`` the options and help, ``main`` the run
of one command.
"""

from .common import (
    EXIT_ALREADY_RUNNING,
    EXIT_BAD_FILE,
    EXIT_BROKEN_PIPE,
    EXIT_DAEMON_ERROR,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NOT_INSTALLED,
    EXIT_OK,
    EXIT_SERVICE,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    UsageError,
    plural,
)
from .main import main
from .parser import build_parser

__all__ = [
    "EXIT_ALREADY_RUNNING", "EXIT_BAD_FILE", "EXIT_BROKEN_PIPE", "EXIT_DAEMON_ERROR", "EXIT_INTERNAL",
    "EXIT_INTERRUPTED", "EXIT_NOT_INSTALLED", "EXIT_OK", "EXIT_SERVICE", "EXIT_TIMEOUT", "EXIT_UNREACHABLE",
    "EXIT_USAGE", "UsageError", "build_parser", "main", "plural",
]  # fmt: skip
