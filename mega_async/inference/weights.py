"""Old import path of the embedded server's weight loading, now mega_async.inference.server.weights."""
from mega_async.inference.server.weights import (WeightBackup, WeightLoadError, check_layout,  # noqa: F401
                                                 check_target, checkpoint_names, load_named_tensors,
                                                 read_safetensors_dir)
