from fuselm.ops.linear_cross_entropy.naive import cross_entropy_rows_ref, linear_cross_entropy_ref
from fuselm.ops.linear_cross_entropy.op import (
    LinearCrossEntropy, LinearCrossEntropyOutput, check_label_values, chunk_rows, linear_cross_entropy,
    linear_cross_entropy_forward,
)

__all__ = [
    "LinearCrossEntropy", "linear_cross_entropy", "linear_cross_entropy_forward", "LinearCrossEntropyOutput",
    "chunk_rows", "check_label_values", "linear_cross_entropy_ref", "cross_entropy_rows_ref",
]
