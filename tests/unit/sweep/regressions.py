# SPDX-License-Identifier: Apache-2.0
"""Named regression cases of the random sweep: cases that once failed, spelled out whole.

Each entry is a full case dict (``cases.py`` documents the keys), so it stays the same case whatever the
drawing code becomes; its comment says what was wrong and where it was found.
"""

REGRESSIONS = {
    # ZenFlow at world 2 with the default bucket size: the ranks all-reduced row-norm vectors of different
    # lengths (gloo aborts) because each laid out only the weights it held a piece of
    "zenflow-default-bucket-w2":
    dict(widths=[32, 64, 8],
         world=2,
         stage=2,
         gas=2,
         dtype="fp32",
         clip=1.0,
         bucket=int(5e8),
         overlap=False,
         offload=True,
         offload_param=False,
         units=None,
         call="engine",
         compile=None,
         zenflow=dict(topk_ratio=0.1, update_interval=2, select_strategy="step", select_interval=2, overlap_step=True),
         steps=6),
    # ... and with equal lengths (8->8->8) added the norms of different weights: a wrong selection, silently
    "zenflow-default-bucket-8x8x8-w3":
    dict(widths=[8, 8, 8],
         world=3,
         stage=1,
         gas=1,
         dtype="fp32",
         clip=0.0,
         bucket=int(5e8),
         overlap=True,
         offload=True,
         offload_param=False,
         units=None,
         call="engine",
         compile=None,
         zenflow=dict(topk_ratio=0.3, update_interval=1, select_strategy="step", select_interval=2,
                      overlap_step=False),
         steps=5),
}
