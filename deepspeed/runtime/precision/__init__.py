# SPDX-License-Identifier: Apache-2.0
"""Precision: the ``fp16``/``bf16`` sections, loss scaling, overflow checks, master parameters (fp32 or 16-bit) and
the module casts."""
