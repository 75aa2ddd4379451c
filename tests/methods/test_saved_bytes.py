"""Saved bytes do not change: every method's saved tensors on a tiny random Llama are bit-identical to
the digests recorded before the architecture change (``tests/methods/saved_bytes.py``), for this
machine's torch CPU capability."""

import pytest

from tests.methods.saved_bytes import CASES, capability, golden_digests, saved_digests


@pytest.mark.parametrize("case", sorted(CASES))
def test_saved_tensors_are_bit_identical(case, tmp_path):
    wants = golden_digests(case)
    got = saved_digests(case, tmp_path)
    assert all(sorted(got) == sorted(w) for w in wants), "the saved tensor names changed"
    changed = sorted(k for k in wants[0] if all(got[k] != w[k] for w in wants))
    assert not changed, f"{case} ({capability()}): saved bytes changed in {changed[:5]}"
