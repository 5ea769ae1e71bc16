# SPDX-License-Identifier: Apache-2.0
"""Names of the multi-node launchers and related defaults, as upstream spells them."""

PDSH_LAUNCHER = "pdsh"
PDSH_MAX_FAN_OUT = 1024

OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
IMPI_LAUNCHER = "impi"
SLURM_LAUNCHER = "slurm"
MVAPICH_LAUNCHER = "mvapich"
MVAPICH_TMP_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"

ELASTIC_TRAINING_ID_DEFAULT = "123456789"

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
