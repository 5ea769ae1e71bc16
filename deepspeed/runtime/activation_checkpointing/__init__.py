# SPDX-License-Identifier: Apache-2.0
"""Activation checkpointing (``deepspeed.checkpointing``): recompute activations in backward, not store them."""
