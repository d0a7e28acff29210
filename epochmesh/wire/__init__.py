"""Tensors on the wire: the codec, compression and safetensors files. May import: epochmesh's flat modules."""
