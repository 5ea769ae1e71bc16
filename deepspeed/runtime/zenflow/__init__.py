# SPDX-License-Identifier: Apache-2.0
"""ZenFlow: stall-free offload for ZeRO stages 1 and 2 (see ``zenflow_step.py``)."""
