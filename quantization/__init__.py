"""Layered quantization (MXFP8 indexer, FP8 KV cache, the HF quantizer): lands with its own issue."""
