# SPDX-License-Identifier: Apache-2.0
"""A Hugging Face ``tp_plan`` as layer specs (upstream's ``TPPlanConverter``).

A plan maps module patterns (``model.layers.*.self_attn.q_proj``, ``*`` any one name) to styles:
``colwise``, ``colwise_gather_output`` (its older name ``colwise_rep``), ``rowwise`` (and
``rowwise_rep``), ``packed_colwise`` (a fused ``[gate; up]``) and ``replicated_with_grad_allreduce``
become column, gathered column, row, two-part column and skip-with-grad-sum specs on the module's
weight. Embeddings (``embedding_rowwise`` / ``embedding_colwise``, what Transformers adds for a tied
head) and ``replicate`` are left whole: the embedding's output is replicated either way, so the
rest of the plan computes the same model. A plan with any other style is refused as a whole:
applying half of a column/row pair would compute a wrong model.
"""

import re

from deepspeed.module_inject.autotp_config import PartitionType, TPLayerSpec

SUPPORTED_STYLES = ("colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_rep", "packed_colwise",
                    "replicated_with_grad_allreduce", "embedding_rowwise", "embedding_colwise", "replicate")
LEFT_WHOLE = ("embedding_rowwise", "embedding_colwise", "replicate")


class TPPlanConverter:

    @staticmethod
    def convert(hf_tp_plan):
        """The plan as a list of :class:`TPLayerSpec` (None for an empty plan); ValueError for unsupported styles."""
        if not hf_tp_plan:
            return None
        unsupported = sorted({str(s) for s in hf_tp_plan.values() if str(s).lower() not in SUPPORTED_STYLES})
        if unsupported:
            raise ValueError(
                f"AutoTP: unsupported partition style(s) {unsupported} in the model's tp_plan (supported: "
                f"{list(SUPPORTED_STYLES)}); give 'tensor_parallel.partition_config' for this model")
        specs = []
        for pattern, style in hf_tp_plan.items():
            style = str(style).lower()
            regex = TPPlanConverter._wildcard_to_regex(pattern) + r"\.weight$"
            if style in LEFT_WHOLE:
                specs.append(TPLayerSpec(patterns=[regex], partition_type=PartitionType.SKIP))
            elif style in ("rowwise", "rowwise_rep"):
                specs.append(TPLayerSpec(patterns=[regex], partition_type=PartitionType.ROW))
            elif style == "packed_colwise":
                specs.append(
                    TPLayerSpec(patterns=[regex], partition_type=PartitionType.COLUMN, shape=(2, -1), partition_dim=0))
            elif style == "replicated_with_grad_allreduce":
                specs.append(TPLayerSpec(patterns=[regex], partition_type=PartitionType.SKIP, grad_allreduce=True))
            else:
                specs.append(
                    TPLayerSpec(patterns=[regex],
                                partition_type=PartitionType.COLUMN,
                                gather_output=style != "colwise"))
        return specs

    @staticmethod
    def _wildcard_to_regex(pattern):
        """``layers.*.q_proj`` -> a regex matching the full parameter path that ends with it."""
        parts = [r"[^.]+" if part == "*" else re.escape(part) for part in str(pattern).split(".")]
        return r"(.*\.)?" + r"\.".join(parts)
