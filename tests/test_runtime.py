"""Host-side helpers of fuselm.runtime."""

import triton

from fuselm.runtime import cdiv, next_power_of_2


def test_launch_arithmetic_matches_triton():
    for n in range(0, 1100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
