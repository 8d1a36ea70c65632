"""The files a net is kept in: checkpoints, the inference model, ONNX.

`mg.io.save` / `mg.io.load` write and read a net's persistables, or some of
their parts, as one versioned .npz, and `mg.io.load_parameters` reads a plain
mapping of arrays (checkpoint.py; which array sets which variable in
checkpoint_match.py, on the checked reader of npz.py and the value checks of
checkpoint_values.py); `save_inference` / `load_inference` keep a
pruned inference net as a directory (inference_model.py, its JSON format in
model_format.py); `mg.onnx.export` (onnx_export.py) writes the infer branch
as ONNX. Every write is atomic and every read is checked before any data is
used (files.py).
"""
from minigraph.io.checkpoint import FORMAT, PARTS, load, load_parameters, read_checkpoint, save
from minigraph.io.files import atomic_write
from minigraph.io.inference_model import load_inference, save_inference
from minigraph.io.model_format import InferenceModelError
from minigraph.io.npz import CheckpointError, write_npz

__all__ = ["FORMAT", "PARTS", "CheckpointError", "InferenceModelError", "atomic_write", "load",
           "load_inference", "load_parameters", "read_checkpoint", "save", "save_inference",
           "write_npz"]
