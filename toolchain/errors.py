"""Errors a user can meet. The CLI prints their message (no traceback) and exits with code 2."""


class MobcError(Exception):
    """A problem the user can fix; the message says what was wrong and what to do."""


class RecipeError(MobcError):
    """The recipe file is missing, malformed or asks for something impossible."""


class SourceError(MobcError):
    """The model source cannot be found or loaded offline."""


class UnsupportedModelError(MobcError):
    """The model's architecture is not one mobc can capture."""


class VerificationError(MobcError):
    """An emitted graph does not reproduce its reference within tolerance."""


class ArtifactError(MobcError):
    """An artifact folder is missing, incomplete or inconsistent."""


class PassError(MobcError):
    """A graph pass was misconfigured or broke the graph."""


class QuantizeError(MobcError):
    """The quantize stage cannot do what the recipe asks."""


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived: raised from the signal handler so every cleanup (staging folders,
    locks, scratch space) runs as the stack unwinds. Not a MobcError: nothing catches it by accident."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name
