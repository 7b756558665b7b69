"""InfLLM-V2 sparse attention kernels: TileLang kernels compiled ahead of time into one C
library, with a torch layer on top. CUDA tensors run the kernels; CPU tensors run the PyTorch
reference (``infllmv2.reference``), which is also the oracle the kernels are tested against.
"""

from . import compat, phsa, reference
from ._lib import (
    Infllmv2ArgumentError,
    Infllmv2Error,
    Infllmv2UnsupportedError,
    available as library_available,
    build_info,
    library_path,
    selected_arch,
    set_arch_override,
)
from .ops import (compress_keys, compress_keys_kvcache, compressed_capacity, dense_attn_varlen, dense_decode_kvcache,
                  group_scores, max_pool_blocks, select_blocks, select_decode, select_decode_kvcache, sparse_attn_varlen,
                  sparse_decode, sparse_decode_kvcache)
from .attention import SparseConfig, attention, attention_kvcache, attention_padded
from .module import InfLLMv2Attention

try:
    from importlib.metadata import PackageNotFoundError, version as _version

    __version__ = _version("infllmv2")
except PackageNotFoundError:  # a source checkout on sys.path
    __version__ = "0.0.0+source"

__all__ = [
    "attention",
    "attention_padded",
    "attention_kvcache",
    "SparseConfig",
    "InfLLMv2Attention",
    "phsa",
    "dense_attn_varlen",
    "dense_decode_kvcache",
    "compress_keys",
    "compress_keys_kvcache",
    "compressed_capacity",
    "sparse_attn_varlen",
    "sparse_decode",
    "sparse_decode_kvcache",
    "select_blocks",
    "select_decode",
    "select_decode_kvcache",
    "group_scores",
    "max_pool_blocks",
    "build_info",
    "library_available",
    "library_path",
    "selected_arch",
    "set_arch_override",
    "reference",
    "compat",
    "Infllmv2Error",
    "Infllmv2ArgumentError",
    "Infllmv2UnsupportedError",
]
