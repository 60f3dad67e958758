"""KDSA: hybrid KDA + DSA language models for Hugging Face transformers.

Importing this package registers the architecture with the Auto classes, so
`AutoModelForCausalLM.from_pretrained(path)` works without `trust_remote_code`, and registers the "kdsa" quantization
method (quantization_method.py; imported as `modeling_kdsa.quantization`:
`from_pretrained(..., quantization_config=KDSAQuantizationConfig())`).
`save_pretrained` also writes the model files as remote code (`auto_map`), for environments where this package is
not installed; the shipped checkpoints/ folders hold no code.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import KDSACache
from .configuration_kdsa import KDSAConfig
from .dspark import DSparkConfig, DSparkDraftModel
from .modeling_kdsa import KDSAForCausalLM, KDSAModel, KDSAPreTrainedModel
from .quantization_method import KDSAQuantizationConfig, register

AutoConfig.register("kdsa", KDSAConfig, exist_ok=True)
AutoModel.register(KDSAConfig, KDSAModel, exist_ok=True)
AutoModelForCausalLM.register(KDSAConfig, KDSAForCausalLM, exist_ok=True)

# `save_pretrained` then copies configuration_kdsa.py, modeling_kdsa.py and every module they import, and writes
# `auto_map` into config.json.
KDSAConfig.register_for_auto_class()
KDSAModel.register_for_auto_class("AutoModel")
KDSAForCausalLM.register_for_auto_class("AutoModelForCausalLM")

# The "kdsa" quantization method; its public import path is modeling_kdsa.quantization (the quantization/ folder,
# which builds on this package: nothing here imports it, docs/design.md §1).
register()

__all__ = [
    "KDSACache",
    "KDSAConfig",
    "DSparkConfig",
    "DSparkDraftModel",
    "KDSAModel",
    "KDSAForCausalLM",
    "KDSAPreTrainedModel",
    "KDSAQuantizationConfig",
]
