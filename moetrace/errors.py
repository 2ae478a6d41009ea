"""Domain errors. The CLI turns every ``MoetraceError`` into a clean message and exit code 2.

Messages quote the offending values and say how to fix the problem. A sentence of a message that names an
option only some commands have is registered with ``option_hint`` where it is raised; the CLI drops it
(``for_command``) from the message of a command without that option, so messages name only options the
command has.
"""

from __future__ import annotations

from collections.abc import Collection

#: registered sentences (``option_hint``) -> the option each names
_OPTION_HINTS: dict[str, str] = {}


def option_hint(option: str, sentence: str) -> str:
    """Register ``sentence`` (part of a message; it names ``option``) and return it, to be put in the message."""
    _OPTION_HINTS[sentence] = option
    return sentence


def for_command(message: str, options: Collection[str] | None) -> str:
    """``message`` without the registered sentences naming an option not in ``options`` (a command's options;
    None: outside a command, the message as it is)."""
    if options is None:
        return message
    for sentence, option in _OPTION_HINTS.items():
        if option not in options and sentence in message:
            message = message.replace(sentence, "")
    return message


class MoetraceError(Exception):
    "Base class of every error moetrace reports to a user."


class MissingDependencyError(MoetraceError, ImportError):
    "An optional dependency (an extra) is not installed."


class TraceFormatError(MoetraceError):
    "A file or directory does not match the moetrace trace format."


class TraceValidationError(MoetraceError):
    "A trace failed validation; ``problems`` lists every problem found."

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"{len(self.problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in self.problems))


class OutputExistsError(MoetraceError):
    "The output directory holds something incompatible with what would be written."


class TraceBusyError(OutputExistsError):
    "Another process is writing the same trace directory (it holds the writer lock)."


class WriteError(MoetraceError, OSError):
    "Writing an output failed (disk full, I/O error); the message names the cause and what was kept."


class ModelError(MoetraceError):
    "A model preset, path or configuration cannot be used as asked."


class CollectionError(MoetraceError):
    "A collection's engines failed where retrying did not help (Ray shards); the message says what to re-run."


class DatasetError(MoetraceError):
    "A prompt set or dataset cannot be loaded."


class ConfigError(MoetraceError, ValueError):
    "A deployment, placement or analysis configuration is inconsistent."


class EncoderError(MoetraceError):
    "The fast Parquet encoder cannot write what the installed pyarrow expects; the message names the escape hatch."
