"""``fp16_ceil``: the smallest float16 at or above each value, without a device synchronisation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmosaic.errors import ScaleOverflowError
from bitmosaic.formats.grid import FP16_MAX, fp16_ceil

_finite = st.floats(min_value=-FP16_MAX, max_value=FP16_MAX, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(st.lists(_finite, min_size=1, max_size=64))
def test_fp16_ceil_is_the_smallest_float16_not_below(xs):
    x = torch.tensor(xs, dtype=torch.float32)
    c = fp16_ceil(x)
    h = c.to(torch.float16)
    assert torch.equal(h.float(), c)  # representable in float16
    assert (c >= x).all()  # never below: a stored scale never shrinks the range
    below = torch.nextafter(h, torch.full_like(h, float("-inf"))).float()
    assert (below < x).all()  # and the float16 just below it would be
    assert torch.equal(fp16_ceil(x, check=False), c)


def test_fp16_ceil_overflow_is_an_error_unless_the_caller_waives_the_check():
    x = torch.tensor([1.0, 70000.0])
    with pytest.raises(ScaleOverflowError, match="65504"):
        fp16_ceil(x)
    assert fp16_ceil(x, check=False)[1] == float("inf")  # the case the check exists for
    inf_nan = torch.tensor([float("inf"), float("nan")])
    out = fp16_ceil(inf_nan)  # non-finite values pass through (their own errors come elsewhere)
    assert out[0] == float("inf") and out[1].isnan()
