# SPDX-License-Identifier: Apache-2.0
"""``TiledLinear``: a ``Linear`` cut into ``out_splits x in_splits`` tiles that run one after another.

Tile ``linears[o][i]`` maps input columns ``in_parts[i]:in_parts[i+1]`` to output rows
``out_parts[o]:out_parts[o+1]`` (cuts from ``partition_uniform``, larger tiles first); the bias of output
block ``o`` lives on its last input tile. Output block ``o`` is the sum over ``i`` of its tiles, and the
blocks are concatenated along the last dimension (or returned as a list with ``combine_out_splits=False``).
So ``TiledLinear(n, m, ...)`` computes exactly ``x @ W.T + b`` of the ``Linear`` whose blocks the tiles are
(``copy_params_from(linear)`` sets them), and under ZeRO-3 only one tile needs to be gathered at a time.
The module layout (``linears.<o>.<i>.weight``) is upstream's, so state dicts interchange.
"""

import torch

from deepspeed.runtime.zero.partition_parameters import GatheredParameters
from deepspeed.runtime.utils import partition_uniform


def split_tensor_along_last_dim(tensor, partitions, contiguous_split_chunks=False):
    """``torch.split`` of ``tensor`` along its last dimension into chunks of sizes ``partitions``."""
    chunks = torch.split(tensor, partitions, dim=tensor.dim() - 1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


class TiledLinear(torch.nn.Module):
    """See the module docstring. ``linear_cls(in, out, bias=..., **kwargs)`` builds each tile;
    ``input_is_already_split`` takes ``forward``'s input as the list of ``in_splits`` column blocks;
    ``init_linear`` copies its parameters in."""

    def __init__(self,
                 in_features,
                 out_features,
                 bias=True,
                 in_splits=1,
                 out_splits=1,
                 input_is_already_split=False,
                 combine_out_splits=True,
                 linear_cls=torch.nn.Linear,
                 init_linear=None,
                 **kwargs):
        super().__init__()
        if not 1 <= in_splits <= in_features:
            raise RuntimeError("in splits must be in range [1, in_features].")
        if not 1 <= out_splits <= out_features:
            raise RuntimeError("out splits must be in range [1, out_features].")
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.in_splits = in_splits
        self.out_splits = out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = partition_uniform(num_items=in_features, num_parts=in_splits)
        self.out_parts = partition_uniform(num_items=out_features, num_parts=out_splits)
        self.linears = torch.nn.ModuleList()
        for o in range(out_splits):
            row = torch.nn.ModuleList()
            rows = self.out_parts[o + 1] - self.out_parts[o]
            for i in range(in_splits):
                cols = self.in_parts[i + 1] - self.in_parts[i]
                row.append(linear_cls(cols, rows, bias=bias and i == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_):
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            inputs = input_
            if len(inputs) != self.in_splits:
                raise ValueError(f"Col splits {self.in_splits} does not match input splits {len(inputs)}")
        else:
            cuts = partition_uniform(input_.shape[-1], self.in_splits)
            inputs = self._split_global_input(input_, [cuts[p + 1] - cuts[p] for p in range(self.in_splits)])
        outputs = []
        for o in range(self.out_splits):
            block = None
            for i in range(self.in_splits):
                block = self._reduce_local_output(i, o, block, self.linears[o][i](inputs[i]))
            outputs.append(block)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input, split_sizes):
        return split_tensor_along_last_dim(input, split_sizes)

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs):
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other):
        """Set the tiles from the ``[out, in]`` weight (and bias) of ``other``; under ZeRO-3 rank 0's values
        win (a collective)."""
        if tuple(other.weight.size()) != (self.out_features, self.in_features):
            raise ValueError(f"copy_params_from: weight of shape {tuple(other.weight.size())}, expected "
                             f"{(self.out_features, self.in_features)}")
        if self.use_bias != (getattr(other, "bias", None) is not None):
            raise ValueError(f"copy_params_from: bias={self.use_bias} here, but the other layer "
                             f"{'has none' if self.use_bias else 'has one'}")
        for o in range(self.out_splits):
            r0, r1 = self.out_parts[o], self.out_parts[o + 1]
            for i in range(self.in_splits):
                c0, c1 = self.in_parts[i], self.in_parts[i + 1]
                tile = self.linears[o][i]
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(other.weight[r0:r1, c0:c1])
                if tile.bias is not None:
                    with GatheredParameters(tile.bias, modifier_rank=0):
                        tile.bias.copy_(other.bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """Tiles of a ``linear_cls`` that returns ``(output, bias)`` (Megatron's style): outputs are summed over
    input tiles and concatenated; the returned biases are concatenated (None when no tile returns one)."""

    def _reduce_local_output(self, in_id, out_id, current_out, new_out):
        tensor, bias = new_out
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, tensor)
        return tensor, bias if bias is not None else old_bias

    def _combine_output_splits(self, outputs):
        tensor = super()._combine_output_splits([t for t, _ in outputs])
        biases = [b for _, b in outputs if b is not None]
        return tensor, super()._combine_output_splits(biases) if biases else None
