"""Memory layers and the value tables they read.

`MemoryLayer` (base.py) holds what every memory shares: the bag through a value backend (one
autograd function), micro-batching, the record of reads for usage metrics, the Memory+ output. A kind of memory adds its
addressing only: `ProductKeyMemory` (pkm.py). Values live in a backend (backends.py): in this
process (`LocalValues`) or in the memserver cluster (`RemoteValues`), the same numbers either way.
"""

from trainer.memory.backends import LocalValues, RemoteValues, ValueBackend
from trainer.memory.base import MemoryConfig, MemoryLayer, bag
from trainer.memory.metrics import UsageCounter, usage_metrics
from trainer.memory.pkm import ProductKeyMemory

__all__ = [
    "LocalValues",
    "MemoryConfig",
    "MemoryLayer",
    "ProductKeyMemory",
    "RemoteValues",
    "UsageCounter",
    "ValueBackend",
    "bag",
    "usage_metrics",
]
