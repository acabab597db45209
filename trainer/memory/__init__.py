"""Memory layers and the value tables they read.

`MemoryLayer` (base.py) holds what every memory shares: the bag through a value backend (one
autograd function), micro-batching, the record of reads for usage metrics, the Memory+ output. A kind of memory adds its
addressing only: `ProductKeyMemory` (pkm.py), `LSHMemory` (lsh.py), `KIFMemory` (kif.py) and `EngramMemory`
(engram.py: hashed n-grams, addressed by the token ids alone, so its reads can be prefetched). Values
live in a backend (backends.py): in this process (`LocalValues`) or in the memserver cluster
(`RemoteValues`), the same numbers either way; a KIF layer's fixed knowledge lives in a knowledge
source (knowledge.py: in-process faiss or a remote index table) with the same symmetry.
"""

from trainer.memory.backends import LocalValues, RemoteValues, ValueBackend
from trainer.memory.base import KINDS, MemoryConfig, MemoryLayer, bag
from trainer.memory.engram import EngramMemory
from trainer.memory.kif import KIFMemory
from trainer.memory.knowledge import KnowledgeSource, LocalKnowledge, RemoteKnowledge
from trainer.memory.lsh import LSHMemory
from trainer.memory.metrics import UsageCounter, usage_metrics
from trainer.memory.pkm import ProductKeyMemory

__all__ = [
    "KINDS",
    "EngramMemory",
    "KIFMemory",
    "KnowledgeSource",
    "LSHMemory",
    "LocalKnowledge",
    "RemoteKnowledge",
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
