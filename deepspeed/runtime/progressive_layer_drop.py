# SPDX-License-Identifier: Apache-2.0
"""Progressive layer dropping: not built (upstream removed it too; its ``progressive_layer_drop`` config
section is rejected there). ``ProgressiveLayerDrop`` keeps the name for code that imports it; constructing
it raises ``NotImplementedError``."""

from deepspeed.runtime.not_built import not_built_class

ProgressiveLayerDrop = not_built_class("ProgressiveLayerDrop", "progressive layer dropping", module=__name__)
