"""Tile sizes of the kernels, one per purpose (float32 elements; rows = elements // columns)."""

# One thread's dequantized prefill tile in LowBitWeight and BitPlaneWeight (compiled and pure-torch
# paths): 2 MiB, i.e. 128 rows at K = 4096, the best of 16..128 rows measured at batch 64.
PREFILL_TILE_ELEMS = 1 << 19
# MosaicWeight.fused: a dense tile with its residual blocks added, one product per tile (4 MiB).
FUSED_TILE_ELEMS = 1 << 20
# The module kinds' pure-torch tiles (modules/kernel.py: DPQ, wide Huffman integers, row chunks when
# unpacking a kernel): bounded temporaries, 256 KiB.
TORCH_TILE_ELEMS = 1 << 16
