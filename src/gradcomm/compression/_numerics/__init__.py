"""Numerics shared by the compressors, by subject (this package re-exports them all):

* :mod:`~gradcomm.compression._numerics.reductions`: overflow- and underflow-safe norms, means and scales;
* :mod:`~gradcomm.compression._numerics.bits`: bit packing, sign codes, table decoding, majority votes;
* :mod:`~gradcomm.compression._numerics.noise`: stochastic rounding noise;
* :mod:`~gradcomm.compression._numerics.sparse`: top-k and random-k selection, sparse payloads' means.
"""

from gradcomm.compression._numerics.bits import (
    as_uint8,
    decode_bits,
    gather_rows,
    majority_signs,
    pack_bits,
    pack_signs,
    sign_values,
    unpack_bits,
    unpack_signs,
)
from gradcomm.compression._numerics.noise import NOISE_SCALE, add_rounding_noise_, centred_noise
from gradcomm.compression._numerics.reductions import (
    nonzero_or_one,
    ordered_mean,
    safe_mean_abs,
    safe_norm,
    safe_rms,
    safe_std,
    work_dtype,
)
from gradcomm.compression._numerics.sparse import (
    add_in_rank_order,
    dense_rows,
    index_dtype,
    random_subset,
    rank_offsets,
    sample_stride,
    sparse_nonzero,
    top_magnitudes,
    zero_at,
    zeros_in,
)

__all__ = [
    "NOISE_SCALE",
    "add_in_rank_order",
    "add_rounding_noise_",
    "as_uint8",
    "centred_noise",
    "decode_bits",
    "dense_rows",
    "gather_rows",
    "index_dtype",
    "majority_signs",
    "nonzero_or_one",
    "ordered_mean",
    "pack_bits",
    "pack_signs",
    "random_subset",
    "rank_offsets",
    "safe_mean_abs",
    "safe_norm",
    "safe_rms",
    "safe_std",
    "sample_stride",
    "sign_values",
    "sparse_nonzero",
    "top_magnitudes",
    "unpack_bits",
    "unpack_signs",
    "work_dtype",
    "zero_at",
    "zeros_in",
]
