# SPDX-License-Identifier: Apache-2.0
"""Saving and loading a tensor-parallel engine: its files, an exact resume, and loads at other tensor-parallel sizes.

``save_run`` trains a few steps, saves (per tensor-parallel rank files, upstream's names), and returns the
unsharded state; ``load_run`` builds a fresh engine at any tensor-parallel size, loads the native tag or its
universal folder, checks the unsharded state against the saved one, trains one more step and returns the
unsharded state and norm, so that two loads (or a load and the uninterrupted run) can be compared.
"""

import os

from tests.unit.tensor_parallel import reference as ref
from tests.unit.tensor_parallel.cases import config_of


def _train(engine, data, dp_rank):
    for step in data:
        for micro in step:
            ids = micro[dp_rank]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()


def run(save_dir,
        kind,
        tp,
        stage,
        dtype,
        steps_before,
        steps_after,
        load_from=None,
        universal=False,
        save=False,
        seed=0):
    """One engine: optionally load ``load_from`` (a tag), train, optionally save; returns what the caller compares."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import groups
    world = dist.get_world_size()
    gas = 2
    model = ref.build(kind, seed=seed)
    config = config_of(tp, stage, dtype, gas, "adam", 0.0)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    dp_rank = groups.get_data_parallel_rank()
    data = ref.batches(steps_before + steps_after, gas, world // tp, seed=seed + 1)
    loaded = None
    if load_from is not None:
        engine.load_checkpoint(save_dir, tag=load_from)
        loaded = engine._consolidated_16bit_state_dict()
        _train(engine, data[steps_before:], dp_rank)
    else:
        _train(engine, data[:steps_before], dp_rank)
    files = None
    if save:
        loaded = engine._consolidated_16bit_state_dict()  # the state the checkpoint holds
        engine.save_checkpoint(save_dir, tag="saved")
        files = sorted(os.listdir(os.path.join(save_dir, "saved")))
        if dist.get_rank() == 0:
            from deepspeed.checkpoint.ds_to_universal import convert
            convert(os.path.join(save_dir, "saved"), os.path.join(save_dir, "saved_universal"))
        dist.barrier()
        _train(engine, data[steps_before:], dp_rank)
    state = engine._consolidated_16bit_state_dict()
    norm = float(engine.get_global_grad_norm())
    engine.destroy()
    groups.reset_mesh()
    return state, loaded, norm, files
