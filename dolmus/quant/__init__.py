"""Quantization: linear methods (int8, int4, w8a8, fp8, pre-quantized checkpoints) and their kernels."""
