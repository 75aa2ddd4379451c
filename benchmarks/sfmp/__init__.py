"""SFMP: mixed-precision allocation at matched memory, reordering and its decode cost."""
