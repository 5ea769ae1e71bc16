# SPDX-License-Identifier: Apache-2.0
"""Which saved (pipeline x tensor) ranks each rank of a smaller 2D grid takes over.

A :class:`meg_2d_parallel_map` maps a grid position ``(pp_index, tp_index)`` to a list of saved ranks (ranks
are numbered tensor-fastest: rank ``pp * tp_degree + tp``). :func:`reshape_meg_2d_parallel` starts from the saved
grid (each position its own rank) and contracts the tensor axis (each new tensor position takes consecutive saved
tensor positions of its stage), then the pipeline axis (each new stage takes consecutive saved stages of its
tensor position). Only contraction is supported.
"""

from deepspeed.checkpoint.reshape_utils import partition_data


class meg_2d_parallel_map:
    """A map from ``(pp_index, tp_index)`` to lists of saved ranks."""

    def __init__(self, pp_degree, tp_degree):
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.map = {}

    def simple_init(self):
        """Every position holds its own rank (tensor index fastest)."""
        self.map = {
            self._make_key(i // self.tp_degree, i % self.tp_degree): [i]
            for i in range(self.pp_degree * self.tp_degree)
        }

    def add_data(self, pp_index, tp_index, data):
        self._validate_indices(pp_index, tp_index)
        if not isinstance(data, list):
            raise AssertionError(f"data must be a list, got {type(data).__name__}")
        self.map.setdefault(self._make_key(pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index=None, tp_index=None):
        """The ranks at one position, or (an index None) along a whole axis, pipeline-major."""
        self._validate_indices(pp_index, tp_index)
        pps = range(self.pp_degree) if pp_index is None else [pp_index]
        tps = range(self.tp_degree) if tp_index is None else [tp_index]
        return [rank for i in pps for j in tps for rank in self.map[self._make_key(i, j)]]

    def print_data(self, tag):
        print(f"{tag}")
        for key, value in self.map.items():
            print(f"{key} = {value}")

    def _validate_indices(self, pp_index, tp_index):
        if pp_index is not None and not pp_index < self.pp_degree:
            raise AssertionError(f"pp_index {pp_index} >= pp_degree {self.pp_degree}")
        if tp_index is not None and not tp_index < self.tp_degree:
            raise AssertionError(f"tp_index {tp_index} >= tp_degree {self.tp_degree}")

    @staticmethod
    def _make_key(i, j):
        return f"{i},{j}"


def _reshape_tp_dimension(old_2d_map, new_tp_degree):
    new_map = meg_2d_parallel_map(old_2d_map.pp_degree, new_tp_degree)
    for i in range(old_2d_map.pp_degree):
        for j, ranks in enumerate(partition_data(old_2d_map.get_data(pp_index=i), new_tp_degree)):
            new_map.add_data(i, j, ranks)
    return new_map


def _reshape_pp_dimension(old_2d_map, new_pp_degree):
    new_map = meg_2d_parallel_map(new_pp_degree, old_2d_map.tp_degree)
    for j in range(old_2d_map.tp_degree):
        for i, ranks in enumerate(partition_data(old_2d_map.get_data(tp_index=j), new_pp_degree)):
            new_map.add_data(i, j, ranks)
    return new_map


def reshape_meg_2d_parallel(old_pp_degree, old_tp_degree, new_pp_degree, new_tp_degree, verbose=False):
    """The :class:`meg_2d_parallel_map` of the contracted grid (module docstring)."""
    if new_pp_degree > old_pp_degree or new_tp_degree > old_tp_degree:
        raise AssertionError(f"only contraction is supported: pp {old_pp_degree} -> {new_pp_degree}, tp "
                             f"{old_tp_degree} -> {new_tp_degree}")
    old_map = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    old_map.simple_init()
    if verbose:
        old_map.print_data("original_2d_map:")
    tp_map = _reshape_tp_dimension(old_map, new_tp_degree) if old_tp_degree != new_tp_degree else old_map
    if verbose:
        tp_map.print_data("after_tp_reshape:")
    final = _reshape_pp_dimension(tp_map, new_pp_degree) if old_pp_degree != new_pp_degree else tp_map
    if verbose:
        final.print_data("final_2d_map:")
    return final
