# SPDX-License-Identifier: Apache-2.0
"""Sequence parallelism: Ulysses attention (``layer.DistributedAttention``). The HF Transformers integration and the
ALST memory tools are in ``deepspeed.runtime.sequence_parallel``."""
