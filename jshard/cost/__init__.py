"""The cost model (α–β collectives per mesh axis, redistribution between layouts, compute) and the
memory model (live bytes per device at each program point) that propagation, the search and the
memory planners share."""

from jshard.cost._collectives import Comm as Comm
from jshard.cost._collectives import CostModel as CostModel
from jshard.cost._collectives import gathered_layout as gathered_layout
from jshard.cost._collectives import local_bytes as local_bytes
from jshard.cost._collectives import redistribution as redistribution
from jshard.cost._collectives import slice_counter as slice_counter
from jshard.cost._collectives import stages as stages
from jshard.cost._devices import DEVICE_KINDS as DEVICE_KINDS
from jshard.cost._devices import DeviceKind as DeviceKind
from jshard.cost._devices import device_memory as device_memory
from jshard.cost._memory import Fusion as Fusion
from jshard.cost._memory import LiveRanges as LiveRanges
from jshard.cost._memory import array_of as array_of
from jshard.cost._memory import itemsize as itemsize
from jshard.cost._memory import live_ranges as live_ranges
from jshard.cost._memory import paired as paired
from jshard.cost._memory import value_bytes as value_bytes
from jshard.cost._timeline import Timeline as Timeline
