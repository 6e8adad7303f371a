"""Quantization: weight-only int8/int4 methods for linear layers."""
