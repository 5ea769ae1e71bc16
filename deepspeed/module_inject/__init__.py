# SPDX-License-Identifier: Apache-2.0
"""Module replacement for automatic tensor parallelism (AutoTP) in training, under upstream's paths.

``layers``: the tensor-parallel linear layers and ``GatherReplacedLayerParams``; ``tp_shard``: how a
dimension is cut; ``autotp_config``: sharding rules as data and the presets; ``tp_plan_converter``:
a Hugging Face ``tp_plan`` as rules; ``auto_tp``: upstream's ``AutoTP`` entry points.
"""
