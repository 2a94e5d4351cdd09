"""DPLR (the RWKV-7 family) context parallelism, forward + backward, checked against one process.

    torchrun --nproc_per_node=2 -m deltacp.examples.dplr_cp                 # CPU: gloo + the Eigen reference
    torchrun --nproc_per_node=2 -m deltacp.examples.dplr_cp --device cuda   # GPUs: NCCL + the CUDA tier

S <- diag(e^gk) S + k v^T + b (a^T S) on FLA's DPLR test inputs (a unit, b = -a, gk in [-5, 0]); the
single-process op is deltacp.chunk_dplr_delta_rule, the CP op deltacp.cp.chunk_dplr_cp. DPLR has no
grouped values: --value-heads other than --heads is refused.
Prints one row per rank (errors, times, tokens/s, exchange bytes); exits non-zero on a mismatch.
Options: python -m deltacp.examples.dplr_cp --help (the body is in _cp_example.py).
"""

import sys

from ._cp_example import main

if __name__ == "__main__":
    sys.exit(main("dplr"))
