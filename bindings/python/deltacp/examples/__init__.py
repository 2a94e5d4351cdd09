"""deltacp.examples — runnable examples (``python -m deltacp.examples.<name>``).

    torchrun --nproc_per_node=2 -m deltacp.examples.gdn_cp     # Gated DeltaNet, context parallel
    torchrun --nproc_per_node=4 -m deltacp.examples.kda_cp     # Kimi Delta Attention, context parallel
    torchrun --nproc_per_node=2 -m deltacp.examples.dplr_cp    # DPLR (RWKV-7 family), context parallel
    torchrun --nproc_per_node=4 -m deltacp.examples.ring_attention_cp         # softmax attention, ring + zig-zag
    torchrun --nproc_per_node=4 -m deltacp.examples.gdn_layer_cp --cp 2       # a GDN layer, 2 CP x 2 DP groups

See README.md in this folder.
"""
