"""The decode step ahead of time: an AOTInductor package of one KDSA decode step over a `KDSAStaticCache`
(docs/graph-mode.md §14). See README "Graph mode"."""

from .decode_step import DecodeStep, DecodeStepModule, compile_decode_step, export_decode_step, load_decode_step

__all__ = ["DecodeStep", "DecodeStepModule", "compile_decode_step", "export_decode_step", "load_decode_step"]
