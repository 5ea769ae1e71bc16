# SPDX-License-Identifier: Apache-2.0
"""``data_types.keep_in_fp32_modules``: the buffers a model names stay fp32 while it trains in bf16 or fp16.

Hugging Face transformers models list names in two class attributes: ``_keep_in_fp32_modules_strict`` (fp32 under
bf16 and fp16) and ``_keep_in_fp32_modules`` (fp32 under fp16 only). A buffer such as an MoE router's
``e_score_correction_bias`` holds values close together that bf16 cannot tell apart, which changes routing.

The setting, as upstream 0.19.8 reads it:

* ``"auto"`` (default): the names the model's own modules list (the attributes above), each pattern anchored under
  the module that lists it;
* a list of name patterns: ``*`` stands for any characters and a pattern matches anywhere in a buffer's full name
  (``re.search``, as transformers matches them);
* ``[]``: nothing is kept.

Only *buffers* are kept: parameters follow the training dtype whatever the lists say (upstream's scope). A kept
buffer is also brought back to fp32 when it arrives in a lower precision, and ``data_types.buffer_dtype`` does not
apply to it. Under fp32 training nothing is cast, so nothing needs keeping.
"""

import re

import torch

KEEP_IN_FP32_AUTO = "auto"


def keep_in_fp32_pattern(module, setting, dtype):
    """The compiled pattern of ``module``'s buffer names to keep in fp32 (``dtype``: the training dtype), or None."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if setting is None or setting == KEEP_IN_FP32_AUTO:
        patterns = set()
        for prefix, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or ())
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or ())
            for name in names:
                glob = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(prefix)}\..*{glob}" if prefix else glob)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    if not patterns:
        return None
    return re.compile("|".join(sorted(patterns)))


def buffers_to_keep_in_fp32(module, pattern):
    """The floating buffers of ``module`` whose full names match ``pattern``."""
    return [
        buffer for name, buffer in module.named_buffers()
        if buffer is not None and buffer.is_floating_point() and pattern.search(name)
    ]


@torch.no_grad()
def keep_buffers_in_fp32(module, pattern):
    """Bring the matching buffers of ``module`` to fp32 in place; returns how many changed."""
    changed = 0
    for buffer in buffers_to_keep_in_fp32(module, pattern):
        if buffer.dtype != torch.float32:
            buffer.data = buffer.data.float()
            changed += 1
    return changed
