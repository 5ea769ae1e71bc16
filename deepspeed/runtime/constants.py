# SPDX-License-Identifier: Apache-2.0
"""Names and defaults of the DeepSpeed JSON config.

Key strings and default values match the upstream config format, so configs written for upstream DeepSpeed
parse unchanged. The parsing and validation live in ``deepspeed.runtime.config`` and its section modules;
this module only holds the vocabulary they share.
"""

#########################################
# Batch size
#########################################
TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_BATCH_SIZE_DEFAULT = None
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT = None
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
GRADIENT_ACCUMULATION_STEPS_DEFAULT = None
MANAGED_GRADIENT_ACCUMULATION = "managed_gradient_accumulation"
MANAGED_GRADIENT_ACCUMULATION_DEFAULT = True

#########################################
# Optimizer and LR scheduler
#########################################
OPTIMIZER = "optimizer"
OPTIMIZER_TYPE_DEFAULT = None
OPTIMIZER_PARAMS = "params"
TYPE = "type"
LEGACY_FUSION = "legacy_fusion"
LEGACY_FUSION_DEFAULT = False
SCHEDULER = "scheduler"
SCHEDULER_TYPE_DEFAULT = None
SCHEDULER_PARAMS = "params"
MAX_GRAD_NORM = "max_grad_norm"

ZERO_ALLOW_UNTESTED_OPTIMIZER = "zero_allow_untested_optimizer"
ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT = False
ZERO_FORCE_DS_CPU_OPTIMIZER = "zero_force_ds_cpu_optimizer"
ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT = True

# Optimizer types DeepSpeed builds itself (lower-case, as upstream compares them). Any torch.optim
# optimizer class name is accepted as well.
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = (
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    ONEBIT_ADAM_OPTIMIZER,
    ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
    LION_OPTIMIZER,
    MUON_OPTIMIZER,
)
# Extra keys inside optimizer.params for Adam/AdamW.
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True

# Schedulers implemented in deepspeed.runtime.lr_schedules. Any torch.optim.lr_scheduler class name is
# accepted as well.
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
DEEPSPEED_LR_SCHEDULES = (LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR)

#########################################
# Logging
#########################################
STEPS_PER_PRINT = "steps_per_print"
STEPS_PER_PRINT_DEFAULT = 10
WALL_CLOCK_BREAKDOWN = "wall_clock_breakdown"
WALL_CLOCK_BREAKDOWN_DEFAULT = False
MEMORY_BREAKDOWN = "memory_breakdown"
MEMORY_BREAKDOWN_DEFAULT = False
DUMP_STATE = "dump_state"
DUMP_STATE_DEFAULT = False

#########################################
# Gradients and communication
#########################################
GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = 1.0
PRESCALE_GRADIENTS = "prescale_gradients"
PRESCALE_GRADIENTS_DEFAULT = False
GRADIENT_PREDIVIDE_FACTOR = "gradient_predivide_factor"
GRADIENT_PREDIVIDE_FACTOR_DEFAULT = 1.0
GRADIENT_ALLREDUCE_OP = "gradient_allreduce_op"
GRADIENT_ALLREDUCE_OP_MEAN = "mean"
GRADIENT_ALLREDUCE_OP_SUM = "sum"
GRADIENT_ALLREDUCE_OP_DEFAULT = GRADIENT_ALLREDUCE_OP_MEAN
GRADIENT_ALLREDUCE_OP_SUPPORTED = (GRADIENT_ALLREDUCE_OP_MEAN, GRADIENT_ALLREDUCE_OP_SUM)
COMMUNICATION_DATA_TYPE = "communication_data_type"
COMMUNICATION_DATA_TYPE_DEFAULT = None
SEQ_PARALLEL_COMMUNICATION_DATA_TYPE = "seq_parallel_comm_data_type"
SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT = "fp32"
SPARSE_GRADIENTS = "sparse_gradients"
SPARSE_GRADIENTS_DEFAULT = False
DISABLE_ALLGATHER = "disable_allgather"
DISABLE_ALLGATHER_DEFAULT = False
DATALOADER_DROP_LAST = "dataloader_drop_last"
DATALOADER_DROP_LAST_DEFAULT = False

#########################################
# Precision
#########################################
FP16 = "fp16"
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # older spelling of the bf16 section, still accepted
AMP = "amp"
TORCH_AUTOCAST = "torch_autocast"

#########################################
# Sections
#########################################
ZERO_OPTIMIZATION = "zero_optimization"
ACTIVATION_CHECKPOINTING = "activation_checkpointing"
CHECKPOINT = "checkpoint"
AIO = "aio"
DATA_TYPES = "data_types"
GRAD_ACCUM_DTYPE = "grad_accum_dtype"
GRAD_ACCUM_DTYPE_DEFAULT = None
TENSORBOARD = "tensorboard"
CSV_MONITOR = "csv_monitor"
WANDB = "wandb"
COMET = "comet"
ELASTICITY = "elasticity"
SEQUENCE_PARALLEL_SIZE = "sequence_parallel_size"


class ValidationMode:
    """Values of ``checkpoint.tag_validation`` (upper-cased)."""
    WARN = "WARN"
    IGNORE = "IGNORE"
    FAIL = "FAIL"


CHECKPOINT_TAG_VALIDATION_MODES = (ValidationMode.WARN, ValidationMode.IGNORE, ValidationMode.FAIL)

# The string frameworks put in a config to say "fill this in for me". It must be gone before
# deepspeed.initialize; these are the only places where upstream itself gives "auto" a meaning.
AUTO = "auto"
AUTO_ALLOWED_PATHS = frozenset({
    "zero_optimization.zenflow.select_strategy",
    "zero_optimization.zenflow.select_interval",
    "zero_optimization.zenflow.update_interval",
    "pipeline.stages",
    "expert_parallel.top_k",
    "expert_parallel.routed_scaling_factor",
    "expert_parallel.score_func",
    "expert_parallel.score_apply",
    "expert_parallel.combine_impl",
})

# Top-level keys upstream reads. Anything else at the top level is ignored with a warning.
KNOWN_TOP_LEVEL_KEYS = frozenset({
    "log_level",
    TRAIN_BATCH_SIZE,
    TRAIN_MICRO_BATCH_SIZE_PER_GPU,
    GRADIENT_ACCUMULATION_STEPS,
    MANAGED_GRADIENT_ACCUMULATION,
    OPTIMIZER,
    SCHEDULER,
    ZERO_ALLOW_UNTESTED_OPTIMIZER,
    ZERO_FORCE_DS_CPU_OPTIMIZER,
    STEPS_PER_PRINT,
    WALL_CLOCK_BREAKDOWN,
    MEMORY_BREAKDOWN,
    DUMP_STATE,
    GRADIENT_CLIPPING,
    PRESCALE_GRADIENTS,
    GRADIENT_PREDIVIDE_FACTOR,
    GRADIENT_ALLREDUCE_OP,
    COMMUNICATION_DATA_TYPE,
    SEQ_PARALLEL_COMMUNICATION_DATA_TYPE,
    "seq_parallel_communication_data_type",  # upstream's spelling of the key above
    SPARSE_GRADIENTS,
    DISABLE_ALLGATHER,
    DATALOADER_DROP_LAST,
    FP16,
    BFLOAT16,
    BFLOAT16_OLD,
    AMP,
    TORCH_AUTOCAST,
    ZERO_OPTIMIZATION,
    "allgather_size",  # only read with the legacy boolean form of zero_optimization
    ACTIVATION_CHECKPOINTING,
    CHECKPOINT,
    AIO,
    DATA_TYPES,
    TENSORBOARD,
    CSV_MONITOR,
    WANDB,
    COMET,
    ELASTICITY,
    SEQUENCE_PARALLEL_SIZE,
    "comms_logger",
    "flops_profiler",
    "autotuning",
    "compression_training",
    "quantize_training",
    "eigenvalue",
    "gradient_audit",
    "graph_harvesting",
    "hybrid_engine",
    "sparse_attention",
    "pipeline",
    "progressive_layer_drop",
    "curriculum_learning",
    "data_efficiency",
    "nebula",
    "datastates",
    "weight_quantization",
    "compile",
    "timers",
    "tensor_parallel",
    "expert_parallel",
    "use_data_before_expert_parallelism",
    "vocabulary_size",
    "disable_python_gc",
    "log_level",
})

#########################################
# More of upstream's key names and defaults (importable from deepspeed.runtime.constants and .config;
# the parser above reads the same keys)
#########################################
BFLOAT16_CHECK_OVERFLOW_DEFAULT = False
BFLOAT16_ENABLED = "enabled"
BFLOAT16_ENABLED_DEFAULT = False
BFLOAT16_IMMEDIATE_GRAD_UPDATE = "immediate_grad_update"
BFLOAT16_IMMEDIATE_GRAD_UPDATE_DEFAULT = True
BFLOAT16_MASTER_WEIGHTS_AND_GRADS = "bf16_master_weights_and_grads"
BFLOAT16_MASTER_WEIGHTS_AND_GRADS_DEFAULT = False
BFLOAT16_OPTIMIZER_STATES = "bf16_optimizer_states"
BFLOAT16_OPTIMIZER_STATES_DEFAULT = False
BUFFER_DTYPE = "buffer_dtype"
BUFFER_DTYPE_DEFAULT = None
CHECKPOINT_PARALLEL_WRITE = "parallel_write"
CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE = "pipeline_stage"
CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE_DEFAULT = False
CHECKPOINT_TAG_VALIDATION = "tag_validation"
CHECKPOINT_TAG_VALIDATION_DEFAULT = "WARN"
CHECK_OVERFLOW = "check_overflow"
DATA_PARALLEL_GROUP = "data_parallel_group"
DDP_BFLOAT16 = "ddp_bf16"
DISABLE_PYTHON_GC = "disable_python_gc"
DISABLE_PYTHON_GC_DEFAULT = False
FP16_AUTO_CAST = "auto_cast"
FP16_AUTO_CAST_DEFAULT = False
FP16_CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
FP16_CONSECUTIVE_HYSTERESIS_DEFAULT = False
FP16_ENABLED = "enabled"
FP16_ENABLED_DEFAULT = False
FP16_HYSTERESIS = "hysteresis"
FP16_HYSTERESIS_DEFAULT = 2
FP16_INITIAL_SCALE_POWER = "initial_scale_power"
FP16_INITIAL_SCALE_POWER_DEFAULT = 16
FP16_LOSS_SCALE = "loss_scale"
FP16_LOSS_SCALE_DEFAULT = 0
FP16_LOSS_SCALE_WINDOW = "loss_scale_window"
FP16_LOSS_SCALE_WINDOW_DEFAULT = 1000
FP16_MASTER_WEIGHTS_AND_GRADS = "fp16_master_weights_and_grads"
FP16_MASTER_WEIGHTS_AND_GRADS_DEFAULT = False
FP16_MIN_LOSS_SCALE = "min_loss_scale"
FP16_MIN_LOSS_SCALE_DEFAULT = 1
GLOBAL_RANK = "global_rank"
KEEP_IN_FP32_MODULES = "keep_in_fp32_modules"
KEEP_IN_FP32_MODULES_DEFAULT = "auto"
LOAD_UNIVERSAL_CHECKPOINT = "load_universal"
LOAD_UNIVERSAL_CHECKPOINT_DEFAULT = False
LOG_LEVEL = "log_level"
LOG_LEVEL_DEFAULT = None
PARAM_DTYPE = "param_dtype"
PARAM_DTYPE_DEFAULT = None
PIPE_REPLICATED = "ds_pipe_replicated"
ROUTE_ENCODE = "encode"
ROUTE_EVAL = "eval"
ROUTE_PREDICT = "predict"
ROUTE_TRAIN = "train"
TORCH_AUTOCAST_DTYPE = "dtype"
TORCH_AUTOCAST_ENABLED = "enabled"
TORCH_AUTOCAST_ENABLED_DEFAULT = False
TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES = "lower_precision_safe_modules"
USE_DATA_BEFORE_EXPERT_PARALLEL = "use_data_before_expert_parallelism"
USE_DATA_BEFORE_EXPERT_PARALLEL_DEFAULT = False
USE_NODE_LOCAL_STORAGE_CHECKPOINT = "use_node_local_storage"
USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT = False
VOCABULARY_SIZE = "vocabulary_size"
VOCABULARY_SIZE_DEFAULT = None
