# SPDX-License-Identifier: Apache-2.0
"""``deepspeed.moe``: mixture-of-experts layers (importable; not built yet, see layer.py)."""
