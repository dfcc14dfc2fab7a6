"""The errors a stage raises when it cannot run: every refusal of the stage machinery (a damaged file, an input
made under other settings, a stage another process holds) is a `StageError` whose message names the file or field
and what to run; the CLI prints it as one line."""


class StageError(RuntimeError):
    """A stage cannot run: missing/mismatched inputs, a damaged file, a finished stage with another config, ..."""


class FingerprintMismatch(StageError):
    """A stage's input was produced under settings that differ from this stage's config."""


class StageBusy(StageError):
    """Another live process holds the lock of this stage (or of this rank of it)."""
