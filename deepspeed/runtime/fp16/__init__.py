# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``deepspeed.runtime.fp16`` paths: the optimizer classes ``initialize`` returns for fp16 models, and the
loss-scaler classes upstream's checkpoints pickle (the engine's own scaler is ``runtime/precision/loss_scaler.py``)."""
