"""Sharding propagation over the OpGraph (MindSpore's `sharding_propagation`), and emission: the
traced program re-run with the constraints that make XLA follow a plan."""

from jshard.propagate._charges import charge_constraints as charge_constraints
from jshard.propagate._charges import unpriced_dead as unpriced_dead
from jshard.propagate._emit import EMPTY as EMPTY
from jshard.propagate._emit import Rewrite as Rewrite
from jshard.propagate._emit import emission_of as emission_of
from jshard.propagate._emit import emit as emit
from jshard.propagate._engine import Engine as Engine
from jshard.propagate._engine import propagate as propagate
from jshard.propagate._global import propagate_globally as propagate_globally
from jshard.propagate._manual import MANUAL as MANUAL
from jshard.propagate._manual import manual_comms as manual_comms
from jshard.propagate._manual import manual_flops as manual_flops
from jshard.propagate._manual import manual_seconds as manual_seconds
from jshard.propagate._manual import manual_specs as manual_specs
from jshard.propagate._priced import Priced as Priced
from jshard.propagate._priced import priced as priced
from jshard.propagate._result import Decision as Decision
from jshard.propagate._result import Rejected as Rejected
from jshard.propagate._result import Result as Result
from jshard.propagate._result import WeighedLayout as WeighedLayout
