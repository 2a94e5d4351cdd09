"""KDA context parallelism, forward + backward, checked against one process.

    torchrun --nproc_per_node=2 -m deltacp.examples.kda_cp                 # CPU: gloo + the Eigen reference
    torchrun --nproc_per_node=2 -m deltacp.examples.kda_cp --device cuda   # GPUs: NCCL + the fastest CUDA tier

Prints one row per rank (errors, times, tokens/s, exchange bytes); exits non-zero on a mismatch.
Options: python -m deltacp.examples.kda_cp --help (the body is in _cp_example.py).
"""

import sys

from ._cp_example import main

if __name__ == "__main__":
    sys.exit(main("kda"))
