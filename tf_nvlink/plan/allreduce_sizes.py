"""The all-reduce sizes and packs tf_nvlink accepts, and how a size is written: shared by the all-reduce
benchmark (which measures them) and the tune cache (which checks stored records against them).

Example:
    >>> from tf_nvlink.plan.allreduce_sizes import MAX_PACKS, format_size
    >>> format_size(16 * MIB), MAX_PACKS
    ('16M', 64)
"""

from __future__ import annotations

KIB, MIB, GIB = 2**10, 2**20, 2**30
MAX_PACKS = 64  # gradient packs of "nccl"/"hierarchical"
MAX_SIZE = 16 * GIB  # the largest all-reduce size accepted: 16 GiB (1G = 4 GiB buffers are already rare)


def format_size(size: int) -> str:
    """16777216 -> "16M" (the inverse of the benchmark's parse_size where exact).

    Example:
        >>> format_size(1536), format_size(2 * GIB)
        ('1536', '2G')
    """
    for unit, scale in (("G", GIB), ("M", MIB), ("K", KIB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)
