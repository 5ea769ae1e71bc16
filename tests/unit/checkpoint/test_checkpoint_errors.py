# SPDX-License-Identifier: Apache-2.0
"""Bad input raises a clear error on every rank, within the test timeout (no rank left in a collective).

Each scenario runs on 2 ranks; every rank must raise the expected exception type with a
message that names the problem (and the file, for file problems); afterwards the same
engine still saves and loads a good checkpoint (the ranks are still in step).
"""

import os
import shutil

import pytest

from tests.unit.checkpoint import test_checkpoint_resume as common
from tests.unit.common import run_distributed

TIMEOUT_S = 60
OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


def _on_rank0_then_sync(fn):
    import deepspeed.comm as dist
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)


def _scenario(name, engine, tmp, rank):
    """Set the scenario up and return (callable expected to raise, exception type, substrings of the message)."""
    from deepspeed.runtime.checkpoint import CheckpointError
    good = os.path.join(tmp, "good")
    if name == "save_dir_none":
        return lambda: engine.save_checkpoint(None), ValueError, ["None"]
    if name == "save_dir_empty":
        return lambda: engine.save_checkpoint(""), ValueError, ["empty"]
    if name == "load_dir_none":
        return lambda: engine.load_checkpoint(None), ValueError, ["None"]
    if name == "load_dir_empty":
        return lambda: engine.load_checkpoint(""), ValueError, ["empty"]
    if name == "save_dir_none_on_one_rank":
        return lambda: engine.save_checkpoint(good if rank == 0 else None), ValueError, ["rank 1", "None"]
    if name == "tags_differ":  # an error with checkpoint.tag_validation FAIL (WARN, the default, only warns)
        strict = common.build_engine(dict(common.make_config(1, "fp32"), checkpoint={"tag_validation": "FAIL"}),
                                     seed=0)
        return lambda: strict.save_checkpoint(good, tag=f"tag{rank}"), ValueError, [
            "not consistent across ranks", "'tag0'", "'tag1'"
        ]
    if name == "tag_not_a_name":
        return lambda: engine.save_checkpoint(good, tag="a/b"), ValueError, ["a/b"]
    if name == "client_state_reserved":
        return lambda: engine.save_checkpoint(good, client_state={"module": 1}), ValueError, ["reserved"]

    engine.save_checkpoint(good, tag="t")
    tag_dir = os.path.join(good, "t")
    if name == "missing_file":
        _on_rank0_then_sync(lambda: os.remove(os.path.join(tag_dir, OPTIM.format(1))))
        return lambda: engine.load_checkpoint(good), CheckpointError, [OPTIM.format(1), "missing", "rank 1"]
    if name == "missing_file_resharding":  # a stage-0 engine reads every rank's file
        _on_rank0_then_sync(lambda: os.remove(os.path.join(tag_dir, OPTIM.format(1))))
        other = common.build_engine(common.make_config(0, "fp32"), seed=0)
        return lambda: other.load_checkpoint(good), CheckpointError, [OPTIM.format(1), "missing"]
    if name == "missing_model_states":
        _on_rank0_then_sync(lambda: os.remove(os.path.join(tag_dir, MODEL)))
        return lambda: engine.load_checkpoint(good), CheckpointError, [MODEL, "missing"]
    if name == "truncated_file":
        _on_rank0_then_sync(lambda: _truncate(os.path.join(tag_dir, OPTIM.format(0))))
        return lambda: engine.load_checkpoint(good), CheckpointError, [OPTIM.format(0), "truncated", "rank 0"]
    if name == "truncated_model_states":
        _on_rank0_then_sync(lambda: _truncate(os.path.join(tag_dir, MODEL)))
        return lambda: engine.load_checkpoint(good), CheckpointError, [MODEL, "truncated"]
    if name == "file_of_another_save":
        engine.save_checkpoint(good, tag="u")
        _on_rank0_then_sync(
            lambda: shutil.copyfile(os.path.join(good, "u", OPTIM.format(1)), os.path.join(tag_dir, OPTIM.format(1))))
        return lambda: engine.load_checkpoint(good, tag="t"), CheckpointError, [OPTIM.format(1), "different save"]
    if name == "other_model_shape":
        other = common.build_engine(common.make_config(1, "fp32"), seed=0, dim=12)
        return lambda: other.load_checkpoint(good), CheckpointError, ["emb.weight", "(16, 8)", "(16, 12)"]
    if name == "custom_load_fn_raises_on_one_rank":

        def custom_load_fn(src, dst):
            if rank == 1:
                raise RuntimeError("custom loader failed")
            dst.load_state_dict(src)

        return lambda: engine.load_checkpoint(good, custom_load_fn=custom_load_fn), CheckpointError, [
            "rank 1", "custom loader failed"
        ]
    if name == "latest_names_missing_tag":
        _on_rank0_then_sync(lambda: shutil.rmtree(tag_dir))
        return lambda: engine.load_checkpoint(good), CheckpointError, ["latest", "'t'", "does not exist"]
    raise KeyError(name)


def scenario_worker(tmp, name):
    import deepspeed.comm as dist
    common.attach_checkpointing()
    rank = dist.get_rank()
    engine = common.build_engine(common.make_config(1, "fp32"), seed=0)
    common.train(engine, 1, 0, rank)
    call, exc_type, needles = _scenario(name, engine, tmp, rank)
    with pytest.raises(exc_type) as info:
        call()
    message = str(info.value)
    missing = [n for n in needles if n not in message]
    assert not missing, f"rank {rank}: {missing} not in the message: {message}"
    # The ranks are still in step: a good save and load work.
    fresh = os.path.join(tmp, "after")
    engine.save_checkpoint(fresh)
    path, _ = engine.load_checkpoint(fresh)
    assert path is not None
    engine.destroy()
    return message


SCENARIOS = [
    "save_dir_none", "save_dir_empty", "load_dir_none", "load_dir_empty", "save_dir_none_on_one_rank", "tags_differ",
    "tag_not_a_name", "client_state_reserved", "missing_file", "missing_file_resharding", "missing_model_states",
    "truncated_file", "truncated_model_states", "file_of_another_save", "other_model_shape", "latest_names_missing_tag"
]


@pytest.mark.parametrize("name", SCENARIOS)
def test_bad_input_raises_on_every_rank(tmp_path, name):
    messages = run_distributed(scenario_worker, 2, args=(str(tmp_path), name), timeout=TIMEOUT_S)
    assert len(messages) == 2 and all(messages)


def nothing_to_load_worker(tmp):
    common.attach_checkpointing()
    engine = common.build_engine(common.make_config(2, "fp32"), seed=0)
    results = [engine.load_checkpoint(tmp), engine.load_checkpoint(os.path.join(tmp, "absent"))]
    engine.save_checkpoint(tmp, tag="only", save_latest=False)
    results.append(engine.load_checkpoint(tmp))  # no 'latest'
    results.append(engine.load_checkpoint(tmp, tag="other"))  # no such tag
    results.append(engine.load_checkpoint(tmp, tag="only")[0] is not None)
    engine.destroy()
    return results


def test_nothing_to_load_returns_none(tmp_path):
    for result in run_distributed(nothing_to_load_worker, 2, args=(str(tmp_path), ), timeout=TIMEOUT_S):
        assert result == [(None, None)] * 4 + [True]
