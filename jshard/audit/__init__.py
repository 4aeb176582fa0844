"""The audit: what XLA actually emitted (collectives per kind, bytes weighted by loop trip counts)
and the per-device memory of a compiled program; `moved_bytes`, what a loop moves between two calls
where a step returns an argument in another layout than it takes it."""

from jshard.audit._audit import Audit as Audit
from jshard.audit._audit import Collective as Collective
from jshard.audit._audit import MemoryFigures as MemoryFigures
from jshard.audit._audit import audit as audit
from jshard.audit._audit import memory_figures as memory_figures
from jshard.audit._audit import read_collectives as read_collectives
from jshard.audit._moves import moved_between as moved_between
from jshard.audit._moves import moved_bytes as moved_bytes
