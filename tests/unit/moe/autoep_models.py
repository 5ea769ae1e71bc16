# SPDX-License-Identifier: Apache-2.0
"""Tiny random-weight Hugging Face MoE models for the AutoEP tests, one per preset, built from each model's
config class (no download). ``overrides`` change the config (the reference model of a routing-key test);
``seed`` fixes the weights, so two calls with the same seed and other routing options hold the same weights.
"""

import torch

VOCAB = 32


def _routers_random(model, seed):
    """The HF init leaves some routers at zero: give every router (and DeepSeek-V3's correction bias) values."""
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith(("TopkRouter", "TopKRouter")):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * 0.5)
                bias = getattr(module, "e_score_correction_bias", None)
                if bias is not None:
                    bias.copy_(torch.randn(bias.shape, generator=g) * 0.05)


def mixtral(seed=3, experts=4, top_k=2, **overrides):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = dict(vocab_size=VOCAB,
               hidden_size=16,
               intermediate_size=8,
               num_hidden_layers=2,
               num_attention_heads=2,
               num_key_value_heads=1,
               num_local_experts=experts,
               num_experts_per_tok=top_k,
               max_position_embeddings=32,
               output_router_logits=True,
               router_aux_loss_coef=0.05,
               attn_implementation="eager")
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(**{**cfg, **overrides}))


def qwen3_5_moe(seed=4, experts=4, top_k=2, **overrides):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    cfg = dict(vocab_size=VOCAB,
               hidden_size=16,
               moe_intermediate_size=8,
               shared_expert_intermediate_size=12,
               num_hidden_layers=2,
               num_attention_heads=2,
               num_key_value_heads=1,
               head_dim=8,
               num_experts=experts,
               num_experts_per_tok=top_k,
               max_position_embeddings=32,
               linear_num_key_heads=2,
               linear_num_value_heads=2,
               linear_key_head_dim=4,
               linear_value_head_dim=4,
               linear_conv_kernel_dim=2,
               layer_types=["linear_attention", "full_attention"],
               output_router_logits=True,
               router_aux_loss_coef=0.05,
               attn_implementation="eager")
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**cfg, **overrides}))
    _routers_random(model, seed)
    return model


def deepseek_v2(seed=5, experts=4, top_k=2, **overrides):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    cfg = dict(vocab_size=VOCAB,
               hidden_size=16,
               intermediate_size=12,
               moe_intermediate_size=8,
               num_hidden_layers=2,
               num_attention_heads=2,
               num_key_value_heads=2,
               n_routed_experts=experts,
               n_shared_experts=1,
               num_experts_per_tok=top_k,
               first_k_dense_replace=0,
               kv_lora_rank=8,
               q_lora_rank=None,
               qk_rope_head_dim=4,
               qk_nope_head_dim=4,
               v_head_dim=4,
               n_group=2,
               topk_group=1,
               topk_method="group_limited_greedy",
               routed_scaling_factor=1.5,
               max_position_embeddings=32,
               attn_implementation="eager")
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**{**cfg, **overrides}))
    _routers_random(model, seed)
    return model


def deepseek_v3(seed=6, experts=8, top_k=2, **overrides):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = dict(vocab_size=VOCAB,
               hidden_size=16,
               intermediate_size=12,
               moe_intermediate_size=8,
               num_hidden_layers=3,
               num_attention_heads=2,
               num_key_value_heads=2,
               n_routed_experts=experts,
               n_shared_experts=1,
               num_experts_per_tok=top_k,
               first_k_dense_replace=1,
               kv_lora_rank=8,
               q_lora_rank=8,
               qk_rope_head_dim=4,
               qk_nope_head_dim=4,
               v_head_dim=4,
               n_group=4,
               topk_group=2,
               norm_topk_prob=True,
               routed_scaling_factor=2.5,
               max_position_embeddings=32,
               attn_implementation="eager")
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**cfg, **overrides}))
    _routers_random(model, seed)
    return model


def qwen3_moe(seed=4, experts=4, top_k=2, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = dict(vocab_size=VOCAB,
               hidden_size=16,
               intermediate_size=12,
               moe_intermediate_size=8,
               num_hidden_layers=2,
               num_attention_heads=2,
               num_key_value_heads=1,
               head_dim=8,
               num_experts=experts,
               num_experts_per_tok=top_k,
               max_position_embeddings=32,
               decoder_sparse_step=1,
               norm_topk_prob=True,
               output_router_logits=True,
               router_aux_loss_coef=0.05,
               attn_implementation="eager")
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**cfg, **overrides}))
    _routers_random(model, seed)
    return model


MODELS = {
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "qwen3_5_moe": qwen3_5_moe,
    "deepseek_v2": deepseek_v2,
    "deepseek_v3": deepseek_v3
}
