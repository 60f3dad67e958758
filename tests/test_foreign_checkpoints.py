"""Published checkpoints of other model types are refused with a clear error, never loaded silently wrong.

transformers only warns when a config.json of another type reaches `KDSAConfig`, then keeps the fields whose names
match; a DeepSeek-V3.2 folder used to load with random AttnRes and experts. Until conversion exists (issue #11),
`KDSAConfig` raises and names the type."""

import pytest
from transformers import DeepseekV32Config, Glm5NextConfig, KimiLinearConfig

from modeling_kdsa import KDSAConfig, KDSAForCausalLM

FAMILIES = {"kimi_linear": KimiLinearConfig, "deepseek_v32": DeepseekV32Config, "glm5_next": Glm5NextConfig}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("loader", [KDSAConfig, KDSAForCausalLM], ids=["config", "model"])
def test_foreign_config_is_refused_by_name(tmp_path, model_type, loader):
    FAMILIES[model_type]().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"describes a '{model_type}' model, not 'kdsa'"):
        loader.from_pretrained(tmp_path)


def test_own_model_type_still_loads(tmp_path):
    KDSAConfig(num_hidden_layers=4).save_pretrained(tmp_path)
    assert KDSAConfig.from_pretrained(tmp_path).num_hidden_layers == 4
