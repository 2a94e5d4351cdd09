"""deltacp.examples — runnable examples (``python -m deltacp.examples.<name>``).

    torchrun --nproc_per_node=2 -m deltacp.examples.gdn_cp     # Gated DeltaNet, context parallel
    torchrun --nproc_per_node=4 -m deltacp.examples.kda_cp     # Kimi Delta Attention, context parallel

See README.md in this folder.
"""
