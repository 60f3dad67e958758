"""Layered quantization of KDSA models (docs/design.md §4), the public import path: the `kdsa` quantization method
of transformers (`KDSAQuantizationConfig`, `KDSAQuantizer`, `register`; defined in
`modeling_kdsa/quantization_method.py`, which `import modeling_kdsa` registers) and the numeric formats' reference
definitions (`formats`, from `modeling_kdsa/numeric_formats.py`). This folder builds on the model package; the model
package never imports it (docs/design.md §1).

    from modeling_kdsa.quantization import KDSAQuantizationConfig
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=KDSAQuantizationConfig())
"""

from modeling_kdsa.quantization_method import KDSAQuantizationConfig, KDSAQuantizer, register

__all__ = ["KDSAQuantizationConfig", "KDSAQuantizer", "register"]
