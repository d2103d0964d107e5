from fuselm.ops.linear_cross_entropy.naive import chunk_grad_ref, chunk_stats_ref, linear_cross_entropy_ref
from fuselm.ops.linear_cross_entropy.op import (
    LinearCrossEntropy, LinearCrossEntropyOutput, check_label_values, chunk_columns, linear_cross_entropy,
    linear_cross_entropy_forward,
)

__all__ = [
    "LinearCrossEntropy", "linear_cross_entropy", "linear_cross_entropy_forward", "LinearCrossEntropyOutput",
    "chunk_columns", "check_label_values", "linear_cross_entropy_ref", "chunk_stats_ref", "chunk_grad_ref",
]
