"""CUDA kernels (*.cu, shared helpers in *.cuh) and their thin PyCUDA launchers.

A kernel module is either beside its launcher (batch_norm.py beside
batch_norm.cu, ...: plain functions on PyCUDA GPUArrays, usable without the
graph) or map-only: elementwise kernels declared one per line with map.cuh's
macros, launched by map.unary / map.binary, whose signatures map.py reads
from the source. `loader` compiles each module once per context and process;
`launch` derives every launch configuration from shapes and device
properties. Importing any of this imports nothing from pycuda: that happens
at the first launch.

Native CPU kernels sit here the same way: C source beside its launcher
(conv2d_cpu.c + conv2d_cpu.py, plain functions on numpy arrays), built for
this machine by `native` with the system C compiler on first use.
"""
