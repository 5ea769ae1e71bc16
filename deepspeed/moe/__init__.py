# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.moe``: mixture-of-experts layers (``layer.MoE``, expert-parallel all-to-all in ``sharded_moe``) and
AutoEP, which replaces the MoE blocks of Hugging Face models (``autoep``, its presets, router and config)."""
