"""Error types that map onto the CLI's exit codes: UserError -> 2 (bad input), anything else -> 1 (RunFailure: a
failure of the run, reported plainly; other exceptions: internal errors, reported as such)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message names the file, the line (where one applies), the key and what was expected.

    The CLI prints it without a traceback and exits 2. Nothing is written before it is raised.
    """

    exit_code = 2

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None, key: str | None = None):
        self.file, self.line, self.key = file, line, key
        where = ""
        if file:
            where = f"{file}:{line}: " if line else f"{file}: "
        super().__init__(f"{where}{message}")


class MissingDependency(UserError):
    """A stage needs software that is not installed here (TensorRT, TensorRT-LLM, tritonserver, a GPU)."""


class RunFailure(RuntimeError):
    """The run failed for a reason outside bpcompile's code and the user's input: a worker process died or stopped
    answering, a device was lost. The CLI prints the message as an error (not an internal error) and exits 1, so a
    supervisor restarts what failed."""
