# SPDX-License-Identifier: Apache-2.0
"""Convert a ZeRO checkpoint tag (of this package or of upstream DeepSpeed, any stage) into the universal format.

::

    python -m deepspeed.checkpoint.ds_to_universal --input_folder <dir>/<tag> --output_folder <dir>/<tag>_universal \\
        [--inject_missing_state] [--num_extract_workers N] [--num_merge_workers N] [--keep_temp_folder] [--no_strict]

The output folder is upstream's universal layout (``deepspeed/checkpoint/universal_checkpoint.py``);
load it with ``"checkpoint": {"load_universal": true}`` and the output folder's name as the tag (or
a ``latest_universal`` file naming it), on any world size, ZeRO stage and tensor-parallel size (a
checkpoint saved with tensor parallelism is written with whole tensors: every tensor-parallel rank's
files are merged by the layout they record). The model-states files
must carry ``universal_checkpoint_info`` (this package's always do; upstream's only when the client
added it): ``--inject_missing_state`` adds it, as upstream's converter does. The worker-count and
temporary-folder options are accepted for compatibility: the conversion runs in one process and
needs no temporary folder.
"""

import argparse
import glob
import os
import sys

from deepspeed.checkpoint import constants as C
from deepspeed.checkpoint.universal_checkpoint import universal_optimizer_state, write_universal

_optimizer_state = universal_optimizer_state  # the name this module gave it before it moved beside write_universal


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description="Convert a DeepSpeed ZeRO checkpoint to the universal format")
    parser.add_argument("--input_folder", type=str, required=True, help="the checkpoint tag folder to convert")
    parser.add_argument("--output_folder", type=str, required=True, help="the universal folder to write")
    parser.add_argument("--num_extract_workers", default=4, type=int, help="accepted, not used")
    parser.add_argument("--num_merge_workers", default=2, type=int, help="accepted, not used")
    parser.add_argument("--keep_temp_folder", action="store_true", help="accepted, not used (no temporary folder)")
    parser.add_argument("--no_strict", dest="strict", action="store_false", help="accepted, not used")
    parser.add_argument("--inject_missing_state",
                        action="store_true",
                        help="add universal_checkpoint_info to the model states when it is absent")
    return parser.parse_args(argv)


def convert(input_folder, output_folder, inject_missing_state=False):
    """Write the universal folder of the checkpoint tag ``input_folder`` into ``output_folder``."""
    from deepspeed.runtime.checkpoint.saved import SavedCheckpoint
    from deepspeed.runtime.tensor_parallel.checkpoint import merged_full_state
    input_folder = os.path.abspath(input_folder)
    if glob.glob(os.path.join(input_folder, C.LAYER_FILE_PREFIX + "*")):  # a pipeline checkpoint (layer files)
        from deepspeed.runtime.pipe.checkpoint import to_universal
        inject = {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE} if inject_missing_state \
            else None
        return to_universal(input_folder, output_folder, inject)
    root, tag = os.path.dirname(input_folder), os.path.basename(input_folder)
    merged = merged_full_state(root, tag)
    if merged is not None:  # saved tensor parallel: every tensor-parallel rank's files merged into whole tensors
        model_states, full, frozen, scaler, first = merged
        os.makedirs(output_folder, exist_ok=True)
        write_universal(
            output_folder,
            full,
            frozen,
            # whole tensors in one model-states file: read back as a stage-1/2 source (by name)
            universal_optimizer_state(scaler, min(first.saved_stage, 2), first.world_size or 1),
            [],
            model_states=model_states)
        return
    saved = SavedCheckpoint(root, tag, 0)
    ckpt = saved.checkpoint
    inject = None
    if ckpt.get(C.UNIVERSAL_CHECKPOINT_INFO) is None:
        if not inject_missing_state:
            raise ValueError(f"{saved.model_path}: the required '{C.UNIVERSAL_CHECKPOINT_INFO}' entry is missing; "
                             f"pass --inject_missing_state to add it")
        inject = {C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    if not saved.has_optimizer:
        raise NotImplementedError(f"{saved.model_path}: a checkpoint without optimizer state has nothing to convert "
                                  f"(load its module with load_module_only=True)")
    if saved.saved_stage == 0:
        module = ckpt["module"]
        buffers = set(ckpt.get(C.BUFFER_NAMES) or [])
        names = [n for group in ckpt.get(C.PARAM_SHAPES) or [] for n in group] or None
        full, scaler = saved.stage0_full_state(names if names else [n for n in module if n not in buffers])
        frozen = {}
    else:
        full, frozen, scaler = saved.full_state(True)
    if saved.saved_stage < 3:  # the frozen parameters of stages 0-2 live in the module
        trainable = set(full.fp32)
        frozen_names = set(ckpt.get(C.FROZEN_PARAM_SHAPES) or {})
        frozen = {n: v for n, v in ckpt["module"].items() if n in frozen_names and n not in trainable}
    model_files = sorted(glob.glob(os.path.join(input_folder, "*" + C.MODEL_FILE_SUFFIX)))
    os.makedirs(output_folder, exist_ok=True)
    write_universal(output_folder, full, frozen,
                    universal_optimizer_state(scaler, saved.saved_stage, saved.world_size or 1), model_files, inject)


def main(args=None):
    args = parse_arguments(args) if args is None or isinstance(args, list) else args
    print(f"Converting the DeepSpeed checkpoint in {args.input_folder} to a universal checkpoint in "
          f"{args.output_folder}")
    convert(args.input_folder, args.output_folder, args.inject_missing_state)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
