"""Rotations (QuaRot/SpinQuant) against W4A4 collapse, and where rotated W4A4 loses."""
