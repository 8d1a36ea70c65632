"""CUDA kernels (*.cu, shared helpers in common.cuh) and their thin PyCUDA launchers.

One launcher module per kernel module (batch_norm.py beside batch_norm.cu, ...):
plain functions on PyCUDA GPUArrays, usable without the graph. `loader`
compiles each module once per context and process; `launch` derives every
launch configuration from shapes and device properties. Importing any of this
imports nothing from pycuda: that happens at the first launch.
"""
