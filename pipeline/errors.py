"""The project's own errors: every refusal a user can repair is a `UserError` whose message names the culprit (the
file, the key, the field) and what to do; `drafter.cli.main` (the one error boundary) prints it as one line,
`drafter <command>: error: <message>`, and exits with its `exit_status` (2). Anything else that escapes a command is
a bug: the boundary prints its traceback and asks for a report, except memory running out (`is_out_of_memory`): a
resource limit, one line naming what to lower.

    UserError
     ├── ConfigError (pipeline/config.py)   a config key, value, file or environment variable
     └── StageError                         the stage machinery refuses to run
          ├── FingerprintMismatch           an input made under other settings
          ├── StageBusy                     another process holds the stage
          ├── DamagedFile                   a manifest, state file, shard, export or report of the wrong shape
          └── Preempted (train/preempt.py)  stopped by the scheduler: exit 75, run it again
"""


class UserError(Exception):
    """An error the user can repair; the message says what is wrong and what to do, in one line where it can."""

    exit_status = 2


class StageError(UserError, RuntimeError):
    """A stage cannot run: missing/mismatched inputs, a damaged file, a finished stage with another config, ..."""


class FingerprintMismatch(StageError):
    """A stage's input was produced under settings that differ from this stage's config."""


class StageBusy(StageError):
    """Another live process holds the lock of this stage (or of this rank of it)."""


class DamagedFile(StageError):
    """A file the pipeline reads is not what its writer writes (not JSON, the wrong JSON type, a field missing or of
    another type, a header that contradicts the file): `path`, the `problem` and the `repair` (what to run)."""

    def __init__(self, path, problem: str, repair: str):
        self.path, self.problem, self.repair = path, problem, repair
        super().__init__(f"{path}: {problem}: the file is damaged" + (f". {repair}" if repair else ""))

    def __reduce__(self):  # rebuilt from its three parts: a stage's worker process raises it to the stage's process
        return type(self), (self.path, self.problem, self.repair)


CPU_ALLOCATOR_FAILED = "DefaultCPUAllocator: can't allocate memory"  # torch's host allocator refusing


def is_out_of_memory(e: BaseException) -> bool:
    """torch's device allocator out of memory (torch.OutOfMemoryError: CUDA and the other accelerators), or its CPU
    allocator refused (a plain RuntimeError). Never a bad input: a stage stops on it (finished units kept) rather than
    count the request it was serving as failed."""
    return (type(e).__name__ == "OutOfMemoryError" and type(e).__module__.startswith("torch")) \
        or CPU_ALLOCATOR_FAILED in str(e)
