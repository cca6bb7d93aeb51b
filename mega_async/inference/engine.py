"""Old import path of the embedded server's batching engine, now mega_async.inference.server.engine."""
from mega_async.inference.server.engine import EngineRefused, GenerationEngine, GenRequest  # noqa: F401
from mega_async.inference.server.sampling import sample  # noqa: F401
