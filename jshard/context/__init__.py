"""Context parallel: attention over a sequence cut across devices, in three forms (all-gather of
keys and values, ring, Ulysses), chosen by the cost model."""

from jshard.context._attention import attention as attention
from jshard.context._attention import context_choice as context_choice
from jshard.context._choose import AttentionShape as AttentionShape
from jshard.context._choose import ContextChoice as ContextChoice
from jshard.context._choose import choose as choose
from jshard.context._forms import unzigzag as unzigzag
from jshard.context._forms import zigzag as zigzag
